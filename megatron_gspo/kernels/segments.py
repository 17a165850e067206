"""Per-sequence reductions over packed tokens (`cu_seqlens`): deterministic, no atomics.

Packed layout: sequence b owns tokens [cu_seqlens[b], cu_seqlens[b+1]); tokens at or beyond cu_seqlens[-1]
belong to no sequence (padding). Empty sequences and sequences whose tokens are all masked give sum 0 and
count 0.

Why these choices:
- torch backend (`segment_sums_torch`): difference of a float64 prefix sum. `index_add_` / `scatter_add_` use
  atomics on CUDA (run-to-run bits differ); a prefix sum has a fixed order. Float64 because an fp32 prefix
  over a long pack loses the low bits of short sequences: |prefix| grows to N * |logp|, so an fp32 difference
  would carry an error of ~eps32 * N * |logp|; in float64 it is far below fp32 output precision. The
  per-sequence and per-token values themselves stay fp32.
- Triton backend: one program per sequence walks its tokens in order (`triton_logprob.segment_sums`).
- Backward (`fold_token_grads`): each token reads its own sequence's gradient, a gather: no reduction at all.

Shape legend: N tokens, B sequences; `_N` [N], `_B` [B], `_B1` [B + 1].
"""

from __future__ import annotations

import torch


def segment_sums_torch(
    values_N: torch.Tensor, active_N: torch.Tensor, cu_seqlens_B1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of the active `values_N` (fp32 [B]) and count of active tokens (int64 [B])."""
    keep_N = active_N.bool()
    zero = values_N.new_zeros(1, dtype=torch.float64)
    prefix = torch.cat([zero, torch.where(keep_N, values_N.double(), 0.0).cumsum(0)])
    prefix_count = torch.cat([zero.long(), keep_N.long().cumsum(0)])
    starts, ends = cu_seqlens_B1[:-1].long(), cu_seqlens_B1[1:].long()
    sums_B = (prefix[ends] - prefix[starts]).float()
    counts_B = prefix_count[ends] - prefix_count[starts]
    return sums_B, counts_B


def token_segment_ids(cu_seqlens_B1: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Sequence index of every token (int64 [N]); tokens past cu_seqlens[-1] get B (no sequence)."""
    positions_N = torch.arange(n_tokens, device=cu_seqlens_B1.device, dtype=cu_seqlens_B1.dtype)
    return torch.searchsorted(cu_seqlens_B1[1:].contiguous(), positions_N, right=True)


def fold_token_grads(
    grad_token_N: torch.Tensor | None,
    grad_seq_B: torch.Tensor | None,
    active_N: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
) -> torch.Tensor:
    """One fp32 upstream gradient per token for both outputs (token_logprobs, seq_sum); 0 where masked.

    grad_t = grad_token[t] + grad_seq[seq(t)], since seq_sum[b] sums logp_t over the active tokens of b.
    """
    N = active_N.shape[0]
    grad_N = torch.zeros(N, dtype=torch.float32, device=active_N.device)
    if grad_token_N is not None:
        grad_N = grad_N + grad_token_N.float()
    if grad_seq_B is not None and grad_seq_B.numel() > 0:
        padded_B = torch.cat([grad_seq_B.float(), grad_seq_B.new_zeros(1, dtype=torch.float32)])
        grad_N = grad_N + padded_B[token_segment_ids(cu_seqlens_B1, N)]
    return torch.where(active_N.bool(), grad_N, 0.0)
