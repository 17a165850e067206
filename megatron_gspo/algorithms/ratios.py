"""Importance ratios between the current and the old policy (GSPO Eq.7, GRPO token ratio of Eq.2).

Legend: B = sequences (rows), T = response-token positions (columns, right-padded), `*_BT` per token, `*_B`
per sequence. Every function computes in fp32 (or fp64 when given fp64), whatever the input dtype.

Numerics
- Masked positions are replaced by 0 BEFORE any arithmetic, so padding that holds garbage (inf, -inf, NaN) can
  produce neither a NaN value nor a NaN gradient (the gradient into a masked position is exactly 0).
- The sequence ratio is exp of the masked MEAN of token log-ratios: the mean stays in the range of a single
  token's log-ratio however long the response is, so nothing overflows on the way (a product of ratios would).
- Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (exp(20) ~ 4.9e8) so that neither
  the ratio nor a sum of B such ratios times advantages can overflow fp32. The clamp is straight-through: the
  VALUE is exp(clamp(x)), the GRADIENT is exp(clamp(x)) * dx, i.e. Eq.10/11/17 evaluated at the clamped ratio
  instead of a silent zero. Inside the range (ratios between 2e-9 and 4.9e8) values and gradients are exact.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
"""Bound on |log ratio| before exp; ratios beyond [exp(-20), exp(20)] saturate (value only, see above)."""


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 if any input is fp64 (bf16/fp16 inputs are computed in fp32)."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor.dtype == torch.float64:
            dtype = torch.float64
    return dtype


def check_token_inputs(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> None:
    """Raise a ValueError naming the shapes unless the three inputs are [B, T] tensors of one shape."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape or response_mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must have the same [B, T] shape"
        )


def masked_log_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, response_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log pi_theta - log pi_old, 0 at masked positions; returns (log_ratio_BT, mask_BT as bool).

    `old_logprobs` is detached: pi_old is a constant of the objective, so no gradient may reach it even if the
    caller's tensor requires one.
    """
    check_token_inputs(logprobs_BT, old_logprobs_BT, response_mask_BT)
    dtype = compute_dtype(logprobs_BT, old_logprobs_BT)
    mask_BT = response_mask_BT.bool()
    # Mask each operand separately: inf - inf at a padded position must never be formed.
    new_BT = torch.where(mask_BT, logprobs_BT.to(dtype), 0.0)
    old_BT = torch.where(mask_BT, old_logprobs_BT.detach().to(dtype), 0.0)
    return new_BT - old_BT, mask_BT


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(x), x clamped to +-LOG_RATIO_CLAMP in value only (straight-through gradient, see module doc)."""
    clamped = log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # (x - sg[x]) is exactly 0 in value and 1 in gradient; adding it to sg[clamp(x)] avoids the cancellation
    # that x + sg[clamp(x) - x] would suffer for huge x.
    return torch.exp(clamped + (log_ratio - log_ratio.detach()))


def sequence_log_ratio_from_sums(
    log_ratio_sum_B: torch.Tensor, token_counts_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean token log-ratio per sequence, log s_i of Eq.7, from per-sequence sums; returns (log_s_B, valid_B).

    Sequences with no tokens get log s = 0 (s = 1) and valid = False, with a zero gradient into their sum.
    """
    counts_B = token_counts_B.detach().to(log_ratio_sum_B.dtype)
    valid_B = counts_B > 0
    safe_sum_B = torch.where(valid_B, log_ratio_sum_B, 0.0)
    return safe_sum_B / counts_B.clamp(min=1.0), valid_B


def sequence_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO sequence importance ratio, Eq.7: s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|).

    Computed as s_i = exp((1/|y_i|) sum_t [log pi_theta(y_i,t) - log pi_old(y_i,t)]) over the response tokens
    (`response_mask`), never as a product of token ratios. Differentiable w.r.t. `logprobs` ([B, T]); returns
    [B] fp32 (fp64 for fp64 inputs). Rows without response tokens get s = 1. The log-ratio is clamped to
    +-LOG_RATIO_CLAMP before exp, value only (see the module docstring).
    """
    log_ratio_BT, mask_BT = masked_log_ratio(logprobs, old_logprobs, response_mask)
    log_s_B, _ = sequence_log_ratio_from_sums(log_ratio_BT.sum(dim=-1), mask_BT.sum(dim=-1))
    return clamped_exp(log_s_B)
