"""Rollout / training mismatch correction: importance weights pi_train_old / pi_rollout for rollouts sampled
by another engine (SGLang), whose log-probs differ slightly from the training engine's for the same weights.

Legend: B = sequences, T = token positions, `*_BT` per token, `*_B` per sequence.

The weights are meant to multiply each unit's contribution to the policy loss. Because w >= 0 and
min(s A w, clip(s) A w) = w min(s A, clip(s) A), that is the same as passing `advantages * weights` to the
loss: sequence-level weights [B] with `gspo_loss` (advantages [B]), token-level weights [B, T] with
`gspo_token_loss` or `grpo_loss` (advantages [B, T]).
"""

from __future__ import annotations

import math

import torch

from megatron_gspo.algorithms.metrics import masked_mean_min_max
from megatron_gspo.algorithms.ratios import LOG_RATIO_CLAMP, masked_log_ratio, sequence_log_ratio_from_sums

CORRECTION_LEVELS = ("off", "token", "sequence")
"""Granularity of the importance weight ("off": compute the diagnostics only)."""
CORRECTION_MODES = ("truncate", "mask")
"""What happens to a weight above the threshold: cut to the threshold, or set to 0."""
SEQUENCE_WEIGHTS = ("geometric", "product")
"""Sequence-level weight: exp(mean_t d) (length-normalised, GSPO Eq.7's form) or exp(sum_t d) (the unbiased one)."""
EXTREME_RATIO_TAU = 2.0
"""tau of the R3 paper's F(tau) (arXiv:2510.11370): the fraction of tokens whose train / rollout ratio exceeds it
(logged one-sided, as REFERENCE §11 reads it, and two-sided: ratio > tau or < 1 / tau)."""
PRODUCT_LOG_CLAMP = 50.0
"""|sum_t d| bound for the LOGGED exp(sum) weight (fp64): wide enough to show 1e-18 on long answers, never inf."""
CORRECTION_METRICS = (
    "mismatch_kl",
    "mismatch_kl_k1",
    "mismatch_frac_ratio_above_2",
    "mismatch_frac_ratio_outside_2",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "is_weight_count",
    "is_weight_frac_above",
    "is_weight_frac_below",
    "is_weight_mean_applied",
    "seq_weight_geo_mean",
    "seq_weight_geo_min",
    "seq_weight_geo_max",
    "seq_weight_prod_mean",
    "seq_weight_prod_min",
    "seq_weight_prod_max",
    "seq_log_weight_sum_mean",
    "num_sequences",
    "num_tokens",
)
"""The metric keys `rollout_correction` returns (the step metrics name them mismatch_*)."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_correction(
    level: str, mode: str, threshold: float, mask_below: float | None, sequence_weight: str
) -> None:
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"level={level!r} is unknown; choose off, token or sequence")
    if mode not in CORRECTION_MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose truncate or mask")
    if not (_is_number(threshold) and threshold >= 1.0):
        raise ValueError(
            f"threshold={threshold!r} must be a number >= 1 (weights above it are truncated or masked)"
        )
    if mask_below is not None and not (_is_number(mask_below) and 0.0 <= mask_below <= 1.0):
        raise ValueError(f"mask_below={mask_below!r} must be a number in [0, 1] (weights below it are masked) or None")
    if sequence_weight not in SEQUENCE_WEIGHTS:
        raise ValueError(f"sequence_weight={sequence_weight!r} is unknown; choose geometric or product")


def rollout_correction(
    train_old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "sequence",
    mode: str = "truncate",
    threshold: float = 2.0,
    mask_below: float | None = None,
    sequence_weight: str = "geometric",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights correcting for the rollout engine's sampling; returns (weights, metrics).

    With d_i,t = log pi_train_old(y_i,t) - log pi_rollout(y_i,t) over response tokens:
    - level "token": w_i,t = exp(d_i,t), weights [B, T] (0 at padded positions).
    - level "sequence": w_i = exp((1/|y_i|) sum_t d_i,t), weights [B] - the length-normalised ratio of Eq.7
      applied to the mismatch ("geometric", the default). `sequence_weight="product"` uses the unbiased
      w_i = exp(sum_t d_i,t) instead: that product of token ratios collapses towards 0 (or explodes) on long
      responses, so it is a deliberate choice, never a default. Rows without response tokens get 0.
    - level "off": weights = `response_mask` as floats [B, T] (nothing corrected); metrics are still computed,
      at token level, so the mismatch can be monitored.
    Then mode "truncate": w <- min(w, threshold) (truncated IS); mode "mask": w <- w if w <= threshold else 0
    (masked IS: units the trainer's policy finds far likelier than the sampler did are dropped). With
    `mask_below` (either mode) units whose weight is below it are set to 0 as well: level "token", mode "mask",
    threshold C, mask_below 1/C is icepop's two-sided token mask.
    d is clamped to +-20 before exp (see `ratios`), which only matters far beyond any sensible threshold.

    Inputs are [B, T]; they are detached and computed in fp32 (fp64 for fp64 inputs); the weights are
    detached. Metrics (detached 0-dim fp32), all computed BEFORE truncation / masking:
    - mismatch_kl: KL(pi_rollout || pi_train_old) per token, k3 estimator for samples from pi_rollout,
      mean over tokens of exp(d) - 1 - d; mismatch_kl_k1: mean of -d.
    - is_weight_mean / is_weight_min / is_weight_max: the raw weights over units (tokens for "token" and
      "off", sequences with tokens for "sequence"); is_weight_count: number of those units.
    - is_weight_frac_above: fraction of units with raw weight > threshold (truncated or masked);
      is_weight_frac_below: fraction below `mask_below` (masked; 0 without it);
      is_weight_mean_applied: mean of the weights returned.
    - mismatch_frac_ratio_above_2: F(tau = 2) of the R3 paper, the fraction of response tokens with
      exp(d_i,t) > 2; mismatch_frac_ratio_outside_2: the two-sided count, exp(d_i,t) > 2 or < 1/2 (|d| > log 2),
      for a reading of F(tau) over max(ratio, 1 / ratio).
    - seq_weight_geo_mean / _min / _max: the geometric sequence weight exp(mean_t d) over sequences with tokens;
      seq_weight_prod_mean / _min / _max: the unbiased exp(sum_t d) (its log clamped to +-50, fp64, so that
      1e-18 on a long answer shows as such); seq_log_weight_sum_mean: mean over sequences of sum_t d (exact).
      Both are logged whatever `level` says: they differ by orders of magnitude on long answers.
    - num_sequences (with tokens), num_tokens.
    """
    _check_correction(level, mode, threshold, mask_below, sequence_weight)
    log_ratio_BT, mask_BT = masked_log_ratio(train_old_logprobs.detach(), rollout_logprobs, response_mask)
    log_ratio_BT = log_ratio_BT.detach()
    counts_B = mask_BT.sum(dim=-1)

    sum_B = log_ratio_BT.sum(dim=-1)
    log_geo_B, valid_B = sequence_log_ratio_from_sums(sum_B, counts_B)
    if level == "sequence":
        log_w, valid = (log_geo_B if sequence_weight == "geometric" else sum_B), valid_B
    else:
        log_w, valid = log_ratio_BT, mask_BT
    raw = torch.where(valid, torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0)
    if mode == "truncate":
        applied = raw.clamp(max=threshold)
    else:
        applied = torch.where(raw <= threshold, raw, 0.0)
    below = (raw < mask_below) & valid if mask_below is not None else torch.zeros_like(valid)
    applied = torch.where(below, 0.0, applied)
    weights = mask_BT.to(raw.dtype) if level == "off" else applied

    with torch.no_grad():
        num_units = valid.sum().to(torch.float64).clamp(min=1)
        num_tokens = counts_B.sum().to(torch.float64)
        d_BT = log_ratio_BT.to(torch.float64)
        k3_BT = torch.where(mask_BT, torch.expm1(d_BT.clamp(max=LOG_RATIO_CLAMP)) - d_BT, 0.0)
        weight_mean, weight_min, weight_max = masked_mean_min_max(raw, valid)
        applied_mean = torch.where(valid, weights, 0.0).to(torch.float64).sum() / num_units
        above = ((raw > threshold) & valid).sum() / num_units
        extreme = ((d_BT > math.log(EXTREME_RATIO_TAU)) & mask_BT).sum() / num_tokens.clamp(min=1)
        outside = ((d_BT.abs() > math.log(EXTREME_RATIO_TAU)) & mask_BT).sum() / num_tokens.clamp(min=1)
        sum64_B = sum_B.to(torch.float64)
        geo_mean, geo_min, geo_max = masked_mean_min_max(torch.exp(sum64_B / counts_B.clamp(min=1)), valid_B)
        prod_B = torch.exp(sum64_B.clamp(-PRODUCT_LOG_CLAMP, PRODUCT_LOG_CLAMP))
        prod_mean, prod_min, prod_max = masked_mean_min_max(prod_B, valid_B)
        num_seq = valid_B.sum().to(torch.float64)
        metrics = {
            "mismatch_kl": k3_BT.sum() / num_tokens.clamp(min=1),
            "mismatch_kl_k1": -d_BT.sum() / num_tokens.clamp(min=1),
            "mismatch_frac_ratio_above_2": extreme,
            "mismatch_frac_ratio_outside_2": outside,
            "is_weight_mean": weight_mean,
            "is_weight_min": weight_min,
            "is_weight_max": weight_max,
            "is_weight_count": valid.sum(),
            "is_weight_frac_above": above,
            "is_weight_frac_below": below.sum() / num_units,
            "is_weight_mean_applied": applied_mean,
            "seq_weight_geo_mean": geo_mean,
            "seq_weight_geo_min": geo_min,
            "seq_weight_geo_max": geo_max,
            "seq_weight_prod_mean": prod_mean,
            "seq_weight_prod_min": prod_min,
            "seq_weight_prod_max": prod_max,
            "seq_log_weight_sum_mean": torch.where(valid_B, sum64_B, 0.0).sum() / num_seq.clamp(min=1),
            "num_sequences": (counts_B > 0).sum(),
            "num_tokens": num_tokens,
        }
    return weights.detach(), {key: value.to(torch.float32).reshape(()) for key, value in metrics.items()}
