"""The fp32 oracle: `log_softmax + gather` with plain autograd (REFERENCE.md §5: always test against it).

It materialises [N, V] fp32 log-probs (and autograd keeps them), so it is for tests, benchmarks and debugging,
not for training at vocabulary 151936. It takes the FULL (unsharded) vocabulary.

Shape legend: N tokens, V vocab, B sequences; `_N` [N], `_NV` [N, V], `_B1` [B + 1].
"""

from __future__ import annotations

import torch


def reference_sequence_logprobs(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    loss_mask_N: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_logprobs fp32 [N] (0 where masked), seq_sum fp32 [B], seq_count int64 [B]), differentiable.

    logp_t = log_softmax(logits_t / T)[target_t]; sums over each sequence's selected tokens, slice by slice.
    """
    logprobs_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    token_N = logprobs_NV.gather(1, targets_N.long()[:, None]).squeeze(1)
    keep_N = torch.ones_like(token_N, dtype=torch.bool) if loss_mask_N is None else loss_mask_N.bool()
    token_N = torch.where(keep_N, token_N, 0.0)
    bounds = cu_seqlens_B1.tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    seq_sum_B = torch.stack([token_N[s:e].sum() for s, e in spans]) if spans else token_N.new_zeros(0)
    seq_count_B = torch.tensor([int(keep_N[s:e].sum()) for s, e in spans], dtype=torch.int64)
    return token_N, seq_sum_B, seq_count_B
