"""Overlong answers (DAPO, arXiv:2503.14476 §3.4): the soft overlong punishment added to the reward, and the
statistics of truncated / penalised answers.

Legend: N = sequences, `*_N` per sequence.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lens_N: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (R_length, §3.4) per response, fp32 [N]:
    0 if L <= L_max - L_cache; (L_max - L_cache - L) / L_cache if L_max - L_cache < L <= L_max; -1 beyond;
    times `factor`. L_max = `max_length`, L_cache = `buffer` (0: no penalty)."""
    if buffer < 0 or max_length < 1 or buffer > max_length:
        raise ValueError(
            f"overlong buffer={buffer} must be in [0, max_length={max_length}] (loss.overlong_buffer, "
            "rollout.max_new_tokens)"
        )
    lens = response_lens_N.detach().to(torch.float64)
    if buffer == 0:
        return torch.zeros_like(lens, dtype=torch.float32)
    start = max_length - buffer
    penalty = torch.where(lens <= start, 0.0, (start - lens) / buffer)
    penalty = torch.where(lens > max_length, -1.0, penalty)
    return (penalty * factor).to(torch.float32)


def overlong_stats(truncated_N: torch.Tensor, penalty_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """samples, truncated_frac (finish_reason 'length'), overlong_penalty_mean and overlong_penalized_frac (< 0),
    over this part's sequences (0-dim fp32; combine with `combine_metrics`)."""
    with torch.no_grad():
        n = torch.tensor(float(truncated_N.numel()), dtype=torch.float64)
        pen = penalty_N.detach().to(torch.float64)
        return {
            "samples": n.float(),
            "truncated_frac": (truncated_N.bool().sum() / n.clamp(min=1)).float(),
            "overlong_penalty_mean": (pen.sum() / n.clamp(min=1)).float(),
            "overlong_penalized_frac": ((pen < 0).sum() / n.clamp(min=1)).float(),
        }


def mask_truncated_advantages(advantages_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
    """`loss.mask_truncated`: advantage 0 for responses cut at max_new_tokens, so they contribute no gradient (the
    policy losses are linear in A per sequence, and a zero A is never clipped). `advantages_N` may be per token
    ([N, T]): a truncated row's are all 0."""
    cut = truncated_N.bool() if advantages_N.dim() == 1 else truncated_N.bool()[:, None]
    return torch.where(cut, torch.zeros_like(advantages_N), advantages_N)
