"""Off-policy corrections applied to a policy loss: the decoupled (proximal) objective and the geometric mask band.

Legend: B = sequences, T = token positions, `*_BT` per token, `*_B` per sequence; d_i,t = log pi_prox(y_i,t) -
log pi_behav(y_i,t), with pi_behav the rollout engine's log-probs (the policy that sampled, possibly several weight
versions within one answer) and pi_prox the trainer's recomputed pi_old (rollout.old_logprobs=recompute).

Decoupled PPO (AReaL, arXiv:2505.24298): J = E_behav[ w min(r A, clip(r) A) ] with w = pi_prox / pi_behav and the
clipped ratio r = pi_theta / pi_prox. For GSPO the sequence form, length-normalised like Eq.7:
w_i = exp((1/|y_i|) sum_t d_i,t) and r = s_i of Eq.7 against pi_prox. Because w >= 0,
w min(r A, clip(r) A) = min(r (w A), clip(r) (w A)), so the objective is the policy loss with advantages w A: a
sequence weight scales A_i, a token weight [B, T] becomes per-token advantages (token-level losses only). Its
gradient is w times the loss's (Eq.10 / Eq.11 scaled by w); w itself is a constant (detached).

Geometric mask band (SkyRL, for MoE with R3): a sequence is kept only when lo <= exp(mean_t d_i,t) <= hi; a
dropped sequence gets advantage 0 (no gradient; it still counts in the batch size, like a zero-variance group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gspo.algorithms.config import RolloutCorrectionConfig
from megatron_gspo.algorithms.correction import rollout_correction
from megatron_gspo.algorithms.ratios import masked_log_ratio, sequence_log_ratio_from_sums


@dataclass
class CorrectedAdvantages:
    """What the policy loss is given after the correction."""

    advantages_B: torch.Tensor
    """Per-sequence advantages with the sequence weight and the mask band folded in."""
    token_weights_BT: torch.Tensor | None = None
    """Per-token weights (level token): the loss gets advantages_B[:, None] * token_weights_BT."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """`rollout_correction`'s metrics (before truncation / masking) and geo_mask_frac."""


def geometric_mask_band(
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    low: float | None,
    high: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(keep_B bool, {"geo_mask_frac"}): keep sequence i iff low <= exp((1/|y_i|) sum_t d_i,t) <= high (a None
    bound is no bound). Rows without response tokens are kept (they carry no loss anyway) and not counted;
    geo_mask_frac = dropped / sequences with tokens."""
    d_BT, mask_BT = masked_log_ratio(prox_logprobs.detach(), behav_logprobs, response_mask)
    log_geo_B, valid_B = sequence_log_ratio_from_sums(d_BT.detach().sum(dim=-1), mask_BT.sum(dim=-1))
    geo_B = torch.exp(log_geo_B.to(torch.float64))
    keep_B = torch.ones_like(valid_B)
    if low is not None:
        keep_B &= geo_B >= low
    if high is not None:
        keep_B &= geo_B <= high
    keep_B |= ~valid_B
    dropped = (~keep_B).sum().to(torch.float64) / valid_B.sum().clamp(min=1)
    return keep_B, {"geo_mask_frac": dropped.to(torch.float32).reshape(())}


def corrected_advantages(
    advantages: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> CorrectedAdvantages:
    """The advantages (and token weights) that turn a policy loss into the corrected objective of `cfg` (module
    doc): level "sequence" scales A_i by the (truncated / masked) sequence weight, level "token" returns the
    token weights, level "off" changes nothing; the mask band then zeroes dropped sequences. Inputs: advantages
    [B] (or per-token [B, T], scaled and zeroed per row alike), log-probs [B, T], mask [B, T]; `cfg` is resolved
    here (presets). Metrics are logged before any truncation."""
    cfg = cfg.resolved()
    weights, metrics = rollout_correction(
        prox_logprobs,
        behav_logprobs,
        response_mask,
        level=cfg.level,
        mode=cfg.mode,
        threshold=cfg.threshold,
        mask_below=cfg.mask_below,
        sequence_weight=cfg.sequence_weight,
    )
    out = CorrectedAdvantages(advantages_B=advantages, metrics=metrics)
    per_row = (lambda x: x) if advantages.dim() == 1 else (lambda x: x[:, None])  # [B] or per-token [B, T]
    if cfg.level == "sequence":
        out.advantages_B = advantages * per_row(weights.to(advantages.dtype))
    elif cfg.level == "token":
        out.token_weights_BT = weights
    if cfg.geo_mask_low is not None or cfg.geo_mask_high is not None:
        keep_B, band = geometric_mask_band(
            prox_logprobs, behav_logprobs, response_mask, cfg.geo_mask_low, cfg.geo_mask_high
        )
        out.advantages_B = torch.where(per_row(keep_B), out.advantages_B, 0.0)
        out.metrics.update(band)
    return out
