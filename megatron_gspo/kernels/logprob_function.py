"""Autograd for log-probs from materialised logits: forward statistics, one TP collective, backward from lse.

Forward: per-row (lse, target logit) on this shard -> `combine_vocab_parallel` (one all_gather under TP) ->
token log-probs (0 where masked) -> deterministic per-sequence sums. Saved for backward: logits, targets,
mask, cu_seqlens and the GLOBAL lse [N] (fp32) -- nothing [N, V]-sized beyond the logits the caller holds.
Backward: the upstream gradients of token_logprobs and seq_sum are folded into one fp32 scalar per token, then
one pass over the logits writes d logits = g * (onehot - exp(logits/T - lse)) / T. No collective in the
backward, no recompute of the statistics.

In-place backward (`inplace`, the default for non-leaf logits): d logits is written over the saved logits and
returned as their gradient, so the backward allocates nothing [N, V]-sized (at N=32768, V=151936 bf16 a second
buffer would be 9.96 GB). The logits are consumed: their version counter is bumped, so any other autograd node
that saved the same tensor (and a second backward through this one) fails with torch's "modified by an inplace
operation" error instead of reading gradients as logits. Leaf logits (a user's tensor) always get a new buffer.

`logprob_forward` alone is the forward-only path (old-policy and reference log-probs): no autograd node,
nothing saved; `api.sequence_logprobs` takes it whenever no gradient can be asked for.

Shape legend: N tokens, V vocab columns of this shard, B sequences; `_N` [N], `_NV` [N, V], `_B` [B],
`_B1` [B + 1].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.kernels.backends import LogprobOps
from megatron_gspo.kernels.segments import fold_token_grads
from megatron_gspo.kernels.vocab_parallel import combine_vocab_parallel


def logprob_forward(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    active_N: torch.Tensor,
    cu_seqlens_B1: torch.Tensor,
    inv_temperature: float,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    ops: LogprobOps,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_logprobs_N, seq_sum_B, seq_count_B, global lse_N) without autograd bookkeeping."""
    lse_local_N, target_local_N = ops.row_stats(logits_NV, targets_N, active_N, vocab_start, inv_temperature)
    lse_N, target_logit_N = combine_vocab_parallel(lse_local_N, target_local_N, tp_group)
    token_N = torch.where(active_N.bool(), target_logit_N - lse_N, 0.0)
    seq_sum_B, seq_count_B = ops.segment_sums(token_N, active_N, cu_seqlens_B1)
    return token_N, seq_sum_B, seq_count_B, lse_N


class SequenceLogprobsFunction(torch.autograd.Function):
    """Differentiable w.r.t. `logits_NV` through token_logprobs and seq_sum (seq_count is a count)."""

    @staticmethod
    def forward(
        ctx,
        logits_NV,
        targets_N,
        active_N,
        cu_seqlens_B1,
        inv_temperature,
        tp_group,
        vocab_start,
        ops,
        inplace,
    ):
        args = (logits_NV, targets_N, active_N, cu_seqlens_B1, inv_temperature, tp_group, vocab_start, ops)
        token_N, seq_sum_B, seq_count_B, lse_N = logprob_forward(*args)
        ctx.save_for_backward(logits_NV, targets_N, active_N, cu_seqlens_B1, lse_N)
        ctx.inv_temperature = inv_temperature
        ctx.vocab_start = vocab_start
        ctx.ops = ops
        ctx.inplace = inplace
        ctx.mark_non_differentiable(seq_count_B)
        return token_N, seq_sum_B, seq_count_B

    @staticmethod
    def backward(ctx, grad_token_N, grad_seq_B, _grad_count_B):
        logits_NV, targets_N, active_N, cu_seqlens_B1, lse_N = ctx.saved_tensors
        grad_N = fold_token_grads(grad_token_N, grad_seq_B, active_N, cu_seqlens_B1)
        if ctx.inplace:
            dlogits_NV = logits_NV
        else:
            dlogits_NV = torch.empty_like(logits_NV, memory_format=torch.contiguous_format)
        ctx.ops.dlogits(logits_NV, targets_N, grad_N, lse_N, ctx.vocab_start, ctx.inv_temperature, dlogits_NV)
        if ctx.inplace:
            # A Triton kernel's writes are invisible to autograd: mark the logits as modified explicitly.
            torch.autograd.graph.increment_version(logits_NV)
        return dlogits_NV, None, None, None, None, None, None, None, None
