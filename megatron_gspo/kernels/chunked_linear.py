"""Fused LM head + log-probs: hidden [N, H] x weight [V, H] -> per-token / per-sequence log-probs, no [N, V].

The vocabulary is processed in chunks of C columns: the caller's `chunk_size`, else C such that an fp32 [N, C]
chunk fits `CHUNK_BUDGET_BYTES` (512 MiB on CUDA, where wide chunks keep the GEMMs efficient; 64 MiB on CPU,
where they buy nothing and host memory is the scarce resource).

- forward: logits_NC = hidden @ weight[c].T -> per-row (lse_c, target logit_c) from the backend -> running
  lse = logaddexp(lse, lse_c), target += target_c. Then ONE TP collective, the token log-probs and the
  sequence sums. Saved: hidden, weight (alive anyway as activation / parameter), targets, mask, cu_seqlens
  and lse [N] fp32.
- backward: per chunk, recompute logits_NC (one GEMM), overwrite it in place with d logits_NC from the saved
  lse, then d weight[c] = d logits_NC.T @ hidden (one GEMM, written once: no [V, H] accumulator) and
  d hidden += d logits_NC @ weight[c] (into an fp32 [N, H] accumulator, see `accumulate_fp32`: no bf16
  [N, H] product per chunk, which would round every chunk's partial sum to 8 bits of mantissa).

Working memory beyond inputs and gradients: one [N, C] chunk (the torch backend adds an fp32 scratch of at
most 64 MiB for non-fp32 chunks; bf16 on CPU adds fp32 copies of the d logits chunk and of weight[c] for the
d hidden GEMM) and the fp32 [N, H] d hidden accumulator. FLOPs: 2NHV forward, 6NHV backward
(recompute + two gradient GEMMs) = 8NHV.

Masked tokens (prompt tokens in RL) are dropped before the GEMMs: only the selected rows are multiplied, so a
pack with half its tokens masked costs half the FLOPs. Their d hidden rows are 0.

Tensor parallelism (Megatron's column-parallel LM head): `weight` is this rank's vocab shard and `hidden` the
full (all-gathered) hidden states. The d hidden returned is this rank's PARTIAL gradient,
d logits_local @ weight_local; summing it over the TP group is the caller's job (Megatron does it in the
backward of `copy_to_tensor_model_parallel_region` / `gather_from_sequence_parallel_region`, whichever
produced `hidden`). d weight is complete for the local shard.

Shape legend: N tokens, A selected (unmasked) tokens, H hidden, V vocab rows of this shard, C vocab chunk,
B sequences; `_N` [N], `_NH` [N, H], `_VH` [V, H], `_AC` [A, C], `_B1` [B + 1].
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_gspo.kernels.backends import LogprobOps
from megatron_gspo.kernels.segments import fold_token_grads
from megatron_gspo.kernels.vocab_parallel import combine_vocab_parallel

CHUNK_BUDGET_BYTES = {"cuda": 512 * 2**20, "cpu": 64 * 2**20}
_CHUNK_ALIGN = 128


def vocab_chunk_size(n_rows: int, vocab: int, requested: int | None = None, device_type: str = "cpu") -> int:
    """Vocab columns per chunk: `requested`, else as many as keep an fp32 [n_rows, C] chunk within budget."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"chunk_size={requested} must be positive")
        return min(requested, vocab)
    budget = CHUNK_BUDGET_BYTES.get(device_type, CHUNK_BUDGET_BYTES["cpu"])
    columns = budget // (4 * max(n_rows, 1))
    columns = max(_CHUNK_ALIGN, columns // _CHUNK_ALIGN * _CHUNK_ALIGN)
    return min(columns, vocab)


@functools.cache
def _cuda_addmm_out_dtype() -> bool:
    """Whether this torch's CUDA `addmm.dtype_out` takes an fp32 `input` with bf16 matrices.

    torch 2.13 documents `torch.addmm(input, mat1, mat2, out_dtype, *, out=)` as "supported only on CUDA and for
    torch.float32 given torch.float16/torch.bfloat16 input dtypes" (CPU: NotImplementedError for
    aten::addmm.dtype_out). Earlier releases' CUDA kernel also required `input` to have the matrices' dtype,
    which rules out accumulating into an fp32 buffer; one 1x1 call tells which kind this build is.
    """
    acc = torch.zeros(1, 1, device="cuda")
    one = torch.ones(1, 1, device="cuda", dtype=torch.bfloat16)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(acc.item() == 1.0)


def accumulate_fp32(acc_AH: torch.Tensor, a_AC: torch.Tensor, b_CH: torch.Tensor) -> None:
    """acc_AH += a_AC @ b_CH with fp32 accumulation and no [A, H] temporary in the inputs' precision.

    fp32 inputs: `addmm_`. bf16 / fp16 on CUDA: `torch.addmm(..., out_dtype=torch.float32, out=acc)` (the GEMM
    accumulates in fp32 and adds into the fp32 buffer). Elsewhere (CPU, or a torch whose CUDA kernel refuses an
    fp32 input): both operands upcast to fp32, bounded by the chunk ([A, C] <= the chunk budget, plus [C, H]).
    """
    if a_AC.dtype == torch.float32:
        acc_AH.addmm_(a_AC, b_CH)
    elif a_AC.device.type == "cuda" and _cuda_addmm_out_dtype():
        torch.addmm(acc_AH, a_AC, b_CH, out_dtype=torch.float32, out=acc_AH)
    else:
        acc_AH.addmm_(a_AC.float(), b_CH.float())


def _selected_rows(active_N: torch.Tensor, all_active: bool) -> torch.Tensor | None:
    return None if all_active else active_N.nonzero().squeeze(1)


def _take(tensor: torch.Tensor, rows_A: torch.Tensor | None) -> torch.Tensor:
    return tensor if rows_A is None else tensor.index_select(0, rows_A)


def _scatter(values_A: torch.Tensor, rows_A: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    if rows_A is None:
        return values_A
    out = values_A.new_zeros((n_rows,) + tuple(values_A.shape[1:]))
    return out.index_copy_(0, rows_A, values_A)


def linear_logprob_forward(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    active_N: torch.Tensor,
    all_active: bool,
    cu_seqlens_B1: torch.Tensor,
    inv_temperature: float,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    chunk_size: int | None,
    ops: LogprobOps,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_logprobs_N, seq_sum_B, seq_count_B, global lse_N) without autograd (the forward-only path)."""
    N, V = hidden_NH.shape[0], weight_VH.shape[0]
    rows_A = _selected_rows(active_N, all_active)
    hidden_AH, targets_A = _take(hidden_NH, rows_A), _take(targets_N, rows_A)
    A = hidden_AH.shape[0]
    ones_A = torch.ones(A, dtype=torch.uint8, device=hidden_NH.device)
    lse_A = torch.full((A,), float("-inf"), dtype=torch.float32, device=hidden_NH.device)
    target_A = torch.zeros(A, dtype=torch.float32, device=hidden_NH.device)
    chunk = vocab_chunk_size(A, V, chunk_size, hidden_NH.device.type)
    for v0 in range(0, V if A > 0 else 0, chunk):
        logits_AC = hidden_AH @ weight_VH[v0 : v0 + chunk].t()
        lse_c, target_c = ops.row_stats(
            logits_AC, targets_A, ones_A, vocab_start + v0, inv_temperature, overwrite=True
        )
        del logits_AC
        lse_A = torch.logaddexp(lse_A, lse_c)
        target_A += target_c
    lse_local_N, target_local_N = _scatter(lse_A, rows_A, N), _scatter(target_A, rows_A, N)
    lse_N, target_logit_N = combine_vocab_parallel(lse_local_N, target_local_N, tp_group)
    token_N = torch.where(active_N.bool(), target_logit_N - lse_N, 0.0)
    seq_sum_B, seq_count_B = ops.segment_sums(token_N, active_N, cu_seqlens_B1)
    return token_N, seq_sum_B, seq_count_B, lse_N


def _linear_backward(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    grad_N: torch.Tensor,
    lse_N: torch.Tensor,
    rows_A: torch.Tensor | None,
    need_hidden: bool,
    need_weight: bool,
    inv_temperature: float,
    vocab_start: int,
    chunk_size: int | None,
    ops: LogprobOps,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d hidden_NH (local partial under TP), d weight_VH); recomputes each logits chunk, reuses the lse."""
    N, V = hidden_NH.shape[0], weight_VH.shape[0]
    hidden_AH = _take(hidden_NH, rows_A)
    targets_A, grad_A, lse_A = _take(targets_N, rows_A), _take(grad_N, rows_A), _take(lse_N, rows_A)
    A = hidden_AH.shape[0]
    dhidden_AH = hidden_NH.new_zeros(hidden_AH.shape, dtype=torch.float32) if need_hidden else None
    dweight_VH = torch.zeros_like(weight_VH) if need_weight else None
    chunk = vocab_chunk_size(A, V, chunk_size, hidden_NH.device.type)
    for v0 in range(0, V if A > 0 else 0, chunk):
        weight_CH = weight_VH[v0 : v0 + chunk]
        dlogits_AC = hidden_AH @ weight_CH.t()
        ops.dlogits(dlogits_AC, targets_A, grad_A, lse_A, vocab_start + v0, inv_temperature, dlogits_AC)
        if dweight_VH is not None:
            torch.mm(dlogits_AC.t(), hidden_AH, out=dweight_VH[v0 : v0 + chunk])
        if dhidden_AH is not None:
            accumulate_fp32(dhidden_AH, dlogits_AC, weight_CH)
        del dlogits_AC
    dhidden_NH = None if dhidden_AH is None else _scatter(dhidden_AH.to(hidden_NH.dtype), rows_A, N)
    return dhidden_NH, dweight_VH


class LinearSequenceLogprobsFunction(torch.autograd.Function):
    """Differentiable w.r.t. `hidden_NH` (partial under TP, see the module doc) and `weight_VH`."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH,
        weight_VH,
        targets_N,
        active_N,
        all_active,
        cu_seqlens_B1,
        inv_temperature,
        tp_group,
        vocab_start,
        chunk_size,
        ops,
    ):
        token_N, seq_sum_B, seq_count_B, lse_N = linear_logprob_forward(
            hidden_NH,
            weight_VH,
            targets_N,
            active_N,
            all_active,
            cu_seqlens_B1,
            inv_temperature,
            tp_group,
            vocab_start,
            chunk_size,
            ops,
        )
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, active_N, cu_seqlens_B1, lse_N)
        ctx.all_active = all_active
        ctx.inv_temperature = inv_temperature
        ctx.vocab_start = vocab_start
        ctx.chunk_size = chunk_size
        ctx.ops = ops
        ctx.mark_non_differentiable(seq_count_B)
        return token_N, seq_sum_B, seq_count_B

    @staticmethod
    def backward(ctx, grad_token_N, grad_seq_B, _grad_count_B):
        hidden_NH, weight_VH, targets_N, active_N, cu_seqlens_B1, lse_N = ctx.saved_tensors
        grad_N = fold_token_grads(grad_token_N, grad_seq_B, active_N, cu_seqlens_B1)
        dhidden_NH, dweight_VH = _linear_backward(
            hidden_NH,
            weight_VH,
            targets_N,
            grad_N,
            lse_N,
            _selected_rows(active_N, ctx.all_active),
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.inv_temperature,
            ctx.vocab_start,
            ctx.chunk_size,
            ctx.ops,
        )
        return dhidden_NH, dweight_VH, None, None, None, None, None, None, None, None, None
