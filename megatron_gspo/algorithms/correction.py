"""Rollout / training mismatch correction: importance weights pi_train_old / pi_rollout for rollouts sampled
by another engine (SGLang), whose log-probs differ slightly from the training engine's for the same weights.

Legend: B = sequences, T = token positions, `*_BT` per token, `*_B` per sequence.

The weights are meant to multiply each unit's contribution to the policy loss. Because w >= 0 and
min(s A w, clip(s) A w) = w min(s A, clip(s) A), that is the same as passing `advantages * weights` to the
loss: sequence-level weights [B] with `gspo_loss` (advantages [B]), token-level weights [B, T] with
`gspo_token_loss` or `grpo_loss` (advantages [B, T]).
"""

from __future__ import annotations

import torch

from megatron_gspo.algorithms.metrics import masked_mean_min_max
from megatron_gspo.algorithms.ratios import LOG_RATIO_CLAMP, masked_log_ratio, sequence_log_ratio_from_sums

CORRECTION_LEVELS = ("off", "token", "sequence")
"""Granularity of the importance weight ("off": compute the diagnostics only)."""
CORRECTION_MODES = ("truncate", "mask")
"""What happens to a weight above the threshold: cut to the threshold, or set to 0."""


def _check_correction(level: str, mode: str, threshold: float) -> None:
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"level={level!r} is unknown; choose off, token or sequence")
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose truncate or mask")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 1.0:
        raise ValueError(
            f"threshold={threshold!r} must be a number >= 1 (weights above it are truncated or masked)"
        )


def rollout_correction(
    train_old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "sequence",
    mode: str = "truncate",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights correcting for the rollout engine's sampling; returns (weights, metrics).

    With d_i,t = log pi_train_old(y_i,t) - log pi_rollout(y_i,t) over response tokens:
    - level "token": w_i,t = exp(d_i,t), weights [B, T] (0 at padded positions).
    - level "sequence": w_i = exp((1/|y_i|) sum_t d_i,t), weights [B] - the length-normalised ratio of Eq.7
      applied to the mismatch. Never exp(sum_t d_i,t): that product of token ratios collapses towards 0 (or
      explodes) on long responses. Rows without response tokens get 0.
    - level "off": weights = `response_mask` as floats [B, T] (nothing corrected); metrics are still computed,
      at token level, so the mismatch can be monitored.
    Then mode "truncate": w <- min(w, threshold) (truncated IS); mode "mask": w <- w if w <= threshold else 0
    (masked IS: units the trainer's policy finds far likelier than the sampler did are dropped).
    d is clamped to +-20 before exp (see `ratios`), which only matters far beyond any sensible threshold.

    Inputs are [B, T]; they are detached and computed in fp32 (fp64 for fp64 inputs); the weights are
    detached. Metrics (detached 0-dim fp32), all computed BEFORE truncation / masking:
    - mismatch_kl: KL(pi_rollout || pi_train_old) per token, k3 estimator for samples from pi_rollout,
      mean over tokens of exp(d) - 1 - d; mismatch_kl_k1: mean of -d.
    - is_weight_mean / is_weight_min / is_weight_max: the raw weights over units (tokens for "token" and
      "off", sequences with tokens for "sequence"); is_weight_count: number of those units.
    - is_weight_frac_above: fraction of units with raw weight > threshold (truncated or masked);
      is_weight_mean_applied: mean of the weights returned.
    - num_sequences (with tokens), num_tokens.
    """
    _check_correction(level, mode, threshold)
    log_ratio_BT, mask_BT = masked_log_ratio(train_old_logprobs.detach(), rollout_logprobs, response_mask)
    log_ratio_BT = log_ratio_BT.detach()
    counts_B = mask_BT.sum(dim=-1)

    if level == "sequence":
        log_w, valid = sequence_log_ratio_from_sums(log_ratio_BT.sum(dim=-1), counts_B)
    else:
        log_w, valid = log_ratio_BT, mask_BT
    raw = torch.where(valid, torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0)
    if mode == "truncate":
        applied = raw.clamp(max=threshold)
    else:
        applied = torch.where(raw <= threshold, raw, 0.0)
    weights = mask_BT.to(raw.dtype) if level == "off" else applied

    with torch.no_grad():
        num_units = valid.sum().to(torch.float64).clamp(min=1)
        num_tokens = counts_B.sum().to(torch.float64)
        d_BT = log_ratio_BT.to(torch.float64)
        k3_BT = torch.where(mask_BT, torch.expm1(d_BT.clamp(max=LOG_RATIO_CLAMP)) - d_BT, 0.0)
        weight_mean, weight_min, weight_max = masked_mean_min_max(raw, valid)
        applied_mean = torch.where(valid, weights, 0.0).to(torch.float64).sum() / num_units
        above = ((raw > threshold) & valid).sum() / num_units
        metrics = {
            "mismatch_kl": k3_BT.sum() / num_tokens.clamp(min=1),
            "mismatch_kl_k1": -d_BT.sum() / num_tokens.clamp(min=1),
            "is_weight_mean": weight_mean,
            "is_weight_min": weight_min,
            "is_weight_max": weight_max,
            "is_weight_count": valid.sum(),
            "is_weight_frac_above": above,
            "is_weight_mean_applied": applied_mean,
            "num_sequences": (counts_B > 0).sum(),
            "num_tokens": num_tokens,
        }
    return weights.detach(), {key: value.to(torch.float32).reshape(()) for key, value in metrics.items()}
