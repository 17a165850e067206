"""The clipped surrogate min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) shared by GSPO (Eq.5, r = s_i),
GSPO-token (Eq.14, r = s_i,t) and GRPO (Eq.2, r = w_i,t), the flags saying where its clip is active, and the
checks on clip ranges and normalisers that every loss applies to its arguments.
"""

from __future__ import annotations

from numbers import Integral

import torch


def check_clip(clip_low: float, clip_high: float) -> None:
    """Raise a ValueError unless 0 <= clip_low < 1 and clip_high >= 0."""
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low!r} must be in [0, 1) (the lower clip bound is 1 - clip_low)")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high={clip_high!r} must be >= 0 (the upper clip bound is 1 + clip_high)")


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), elementwise; the per-unit objective to MAXIMISE."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return torch.minimum(unclipped, clipped)


def clip_flags(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) bool flags where the clip is active and the gradient therefore zero.

    low: r < 1 - clip_low with A < 0; high: r > 1 + clip_high with A > 0. (r outside the range with the other
    sign of A is NOT clipped: min() picks the unclipped term there and the gradient flows.)
    """
    with torch.no_grad():
        low = (ratio < 1.0 - clip_low) & (advantages < 0)
        high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return low, high


def check_count(name: str, value: int | None) -> None:
    """Raise a ValueError unless `value` is None or a positive int (a global normaliser)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(
            f"{name}={value!r} must be a positive int (the global count used as the divisor) or None"
        )


def broadcast_token_advantages(
    advantages: torch.Tensor, shape_BT: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """Detached advantages as [B, T] in `dtype`, from [B] (one per sequence) or [B, T] (one per token)."""
    batch, _ = shape_BT
    if advantages.shape == (batch,):
        advantages = advantages[:, None]
    elif advantages.shape != shape_BT:
        raise ValueError(
            f"advantages must be [B]={batch} or [B, T]={tuple(shape_BT)}, got {tuple(advantages.shape)}"
        )
    return advantages.detach().to(dtype).expand(shape_BT)
