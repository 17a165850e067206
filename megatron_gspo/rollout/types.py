"""What a rollout engine returns, and the protocol every engine (local, vLLM, SGLang) implements.

Routed-expert convention (same as SGLang's `return_routed_experts`): one row per token *fed* to the model, i.e.
positions 0 .. len(prompt) + len(response) - 2 (the last sampled token is never an input), shape
[prompt + response - 1, num_moe_layers, topk], stored compactly (uint8 when experts <= 256, else int16).

Weight versions (partial rollouts): a sample whose generation spanned a weight update carries the version that
sampled each response token (`token_versions`). Row r of `routed_experts` is the routing of the forward whose
logits sampled the token at position r + 1 (for r >= len(prompt) - 1: response token r + 1 - len(prompt)), so it
has that token's version; the prompt rows before it come from the first forward, of the first response token's
version (`Rollout.route_versions`). An engine keeps the routes of that forward even when a partial rollout's
continuation recomputes the prefix under newer weights, so each token's routes and log-prob come from the same
weights (versioned R3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """Sampling settings for one `generate` call."""

    max_new_tokens: int = 64
    """Most response tokens per sample."""
    temperature: float = 1.0
    """Softmax temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus mass kept (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling stops after any of these tokens; the stop token is part of the response."""
    n: int = 1
    """Samples per prompt (the group size G); outputs are grouped contiguously per prompt."""
    seed: int | None = None
    """Sampling seed (None: engine default)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"rollout.max_new_tokens={self.max_new_tokens} must be > 0")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.n <= 0:
            raise ValueError(f"rollout.n={self.n} must be > 0")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class Rollout:
    """One sampled response to one prompt."""

    prompt_ids: list[int]
    """Prompt token ids."""
    response_ids: list[int]
    """Generated token ids (the stop token included when finish_reason == 'stop')."""
    logprobs: list[float]
    """The engine's log-prob of each response token (same length as response_ids)."""
    finish_reason: str
    """'stop' (a stop token), 'length' (max_new_tokens) or 'abort'."""
    prompt_index: int = 0
    """Index of the prompt in the `generate` call (the group id)."""
    routed_experts: torch.Tensor | None = None
    """[prompt + response - 1, layers, topk] uint8/int16 expert ids, when the engine records routing (R3)."""
    weight_version: int = 0
    """Policy version that produced the sample: the oldest version among its tokens."""
    token_versions: list[int] | None = None
    """Weight version that sampled each response token (same length as response_ids), for a sample generated
    across weight updates (partial rollouts, or a multi-turn trajectory whose turns span one); None: every token
    is `weight_version`'s. A multi-turn trajectory's environment tokens carry the version of the model turn after
    them, whose prefill ran the forward that scored them, so `route_versions` holds for stitched routes too."""
    extra: dict = field(default_factory=dict)
    """Engine-specific details (e.g. server URL)."""
    loss_mask: list[int] | None = None
    """Multi-turn trajectories (rollout/multiturn/): 1 for each response token the model sampled, 0 for the
    environment's / tool's tokens between its turns (never trained on; their `logprobs` are 0 and unused).
    None: every response token is the model's."""

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the model sampled and is trained on (`loss_mask`'s ones; all of them without one)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"rollout has {len(self.response_ids)} response tokens but {len(self.logprobs)} log-probs"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.response_ids):
            raise ValueError(
                f"rollout has {len(self.response_ids)} response tokens but a loss mask of {len(self.loss_mask)}"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r} must be one of {FINISH_REASONS}")
        if self.token_versions is not None:
            versions = self.token_versions
            if len(versions) != len(self.response_ids):
                raise ValueError(
                    f"rollout has {len(self.response_ids)} response tokens but {len(versions)} token versions"
                )
            if versions and min(versions) != self.weight_version:
                oldest = min(versions)
                problem = f"rollout weight_version={self.weight_version} is not its oldest token's version {oldest}"
                raise ValueError(problem)

    @property
    def versions(self) -> list[int]:
        """The weight version of every response token (`token_versions`, or `weight_version` repeated)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.response_ids)

    @property
    def route_versions(self) -> list[int]:
        """The weight version of every `routed_experts` row (module docstring): row r is the forward that sampled
        the token at position r + 1, so it has that token's version; the rows of the prompt before its last token
        have the first response token's."""
        versions = self.versions
        if not versions:
            return []
        return [versions[0]] * (len(self.prompt_ids) - 1) + versions


def compact_expert_dtype(num_experts: int) -> torch.dtype:
    """Smallest dtype that holds expert ids: uint8 for <= 256 experts, else int16."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit int16 routing storage")


@dataclass(frozen=True)
class RoutingSpec:
    """Shape and range of a routed-experts record."""

    num_layers: int
    """MoE layers L."""
    topk: int
    """Experts per token K."""
    num_experts: int
    """Expert ids must lie in [0, num_experts)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """A source of rollouts: the in-process engine, or vLLM / SGLang servers.

    An engine whose `supports_partial_rollouts` attribute is True may have `update_weights` called from one thread
    while `generate` runs in another: in-flight samples continue under the new weights (their `token_versions`
    say which tokens each version sampled). Without the attribute (or False), weight syncs wait for `generate`
    calls to return.
    """

    weight_version: int

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` rollouts per prompt, grouped contiguously in prompt order."""
        ...

    def update_weights(self, model_chunks: list, version: int) -> None:
        """Makes the engine sample from the trainer's current weights, tagged `version`."""
        ...

    def close(self) -> None:
        """Releases servers / memory; safe to call twice."""
        ...
