"""Policy losses as objects chosen by config: one interface, one class per algorithm, the math in gspo.py
and grpo.py.

The trainer builds one with `make_policy_loss(cfg)` and calls it per micro-batch with the GLOBAL normalisers
of the minibatch; it sums the returned losses. `sequence_level` tells it whether the per-sequence-sums path
(`from_sums`, fed by the log-prob kernel's per-sequence output) is available.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from megatron_gspo.algorithms.config import PolicyLossConfig
from megatron_gspo.algorithms.grpo import GRPO_AGGREGATIONS, grpo_loss
from megatron_gspo.algorithms.gspo import gspo_loss, gspo_loss_from_sums, gspo_token_loss
from megatron_gspo.algorithms.output import PolicyLossOutput
from megatron_gspo.algorithms.surrogate import check_clip


class PolicyLoss(ABC):
    """A policy-gradient loss: `loss(logprobs, old_logprobs, advantages, response_mask, *, num_sequences,
    num_tokens) -> PolicyLossOutput`."""

    name: str = ""
    """The `loss.algorithm` value that selects this class."""
    sequence_level: bool = False
    """True when the loss depends on a sequence only through its log-prob sum (then `from_sums` works)."""

    def __init__(self, clip_low: float, clip_high: float) -> None:
        check_clip(clip_low, clip_high)
        self.clip_low = clip_low
        self.clip_high = clip_high

    @classmethod
    def from_config(cls, cfg: PolicyLossConfig) -> PolicyLoss:
        """Build from `cfg` (clip range resolved to the paper default where unset)."""
        low, high = cfg.clip_range
        return cls(clip_low=low, clip_high=high)

    @abstractmethod
    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        num_sequences: int | None = None,
        num_tokens: int | None = None,
    ) -> PolicyLossOutput:
        """The loss of a (micro-)batch; `num_sequences` / `num_tokens` are the minibatch's global divisors."""

    def from_sums(
        self,
        logprob_sum: torch.Tensor,
        old_logprob_sum: torch.Tensor,
        token_counts: torch.Tensor,
        advantages: torch.Tensor,
        *,
        num_sequences: int | None = None,
    ) -> PolicyLossOutput:
        """The loss from per-sequence log-prob sums; only sequence-level losses support it."""
        raise TypeError(f"loss.algorithm={self.name!r} is token-level and has no per-sequence-sums form")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(clip_low={self.clip_low}, clip_high={self.clip_high})"


class GSPOLoss(PolicyLoss):
    """GSPO, Eq.5 (gradient Eq.10); advantages [B]. `num_tokens` is accepted and unused."""

    name = "gspo"
    sequence_level = True

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        num_sequences: int | None = None,
        num_tokens: int | None = None,
    ) -> PolicyLossOutput:
        return gspo_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            num_sequences=num_sequences,
        )

    def from_sums(
        self,
        logprob_sum: torch.Tensor,
        old_logprob_sum: torch.Tensor,
        token_counts: torch.Tensor,
        advantages: torch.Tensor,
        *,
        num_sequences: int | None = None,
    ) -> PolicyLossOutput:
        """`gspo_loss_from_sums` (Eq.5 from per-sequence sums) with this loss's clip range."""
        return gspo_loss_from_sums(
            logprob_sum,
            old_logprob_sum,
            token_counts,
            advantages,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            num_sequences=num_sequences,
        )


class GSPOTokenLoss(PolicyLoss):
    """GSPO-token, Eq.13-14 (gradient Eq.17); advantages [B, T]. `num_tokens` is accepted and unused."""

    name = "gspo_token"

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        num_sequences: int | None = None,
        num_tokens: int | None = None,
    ) -> PolicyLossOutput:
        return gspo_token_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            num_sequences=num_sequences,
        )


class GRPOLoss(PolicyLoss):
    """GRPO, Eq.2 (gradient Eq.11); advantages [B] or [B, T]."""

    name = "grpo"

    def __init__(self, clip_low: float, clip_high: float, aggregation: str = "seq-mean-token-mean") -> None:
        super().__init__(clip_low, clip_high)
        if aggregation not in GRPO_AGGREGATIONS:
            raise ValueError(
                f"aggregation={aggregation!r} is unknown; choose seq-mean-token-mean or token-mean"
            )
        self.aggregation = aggregation

    @classmethod
    def from_config(cls, cfg: PolicyLossConfig) -> GRPOLoss:
        low, high = cfg.clip_range
        return cls(clip_low=low, clip_high=high, aggregation=cfg.grpo_aggregation)

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        num_sequences: int | None = None,
        num_tokens: int | None = None,
    ) -> PolicyLossOutput:
        return grpo_loss(
            logprobs,
            old_logprobs,
            advantages,
            response_mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            aggregation=self.aggregation,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
        )

    def __repr__(self) -> str:
        clip = f"clip_low={self.clip_low}, clip_high={self.clip_high}"
        return f"GRPOLoss({clip}, aggregation={self.aggregation!r})"


POLICY_LOSSES: dict[str, type[PolicyLoss]] = {cls.name: cls for cls in (GSPOLoss, GSPOTokenLoss, GRPOLoss)}
"""`loss.algorithm` -> PolicyLoss class."""


def make_policy_loss(cfg: PolicyLossConfig) -> PolicyLoss:
    """The PolicyLoss that `cfg.algorithm` names, with `cfg`'s clip range (paper defaults where unset)."""
    return POLICY_LOSSES[cfg.algorithm].from_config(cfg)
