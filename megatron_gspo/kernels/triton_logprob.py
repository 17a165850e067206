"""Triton kernels for per-token / per-sequence log-probs (REFERENCE.md §5), and their launchers.

Three kernels, all on a 1-D launch grid (axis 0 allows 2**31 - 1 programs, so N >= 65536 tokens is fine;
grid axes 1 and 2 overflow at 65535):

- `_row_stats_kernel`: one program per token row. Online (max, sum-exp) over vocab blocks of `logits/T` in
  fp32, giving the local log-sum-exp, plus the row's target logit `/T` when this shard owns the target id.
- `_dlogits_kernel`: one program per row. d logits = g * (onehot - exp(logits/T - lse)) / T from the saved
  lse (no recompute of the statistics); rows with g == 0 (masked tokens) only write zeros. May run in place.
- `_segment_sums_kernel`: one program per sequence, summing the masked token log-probs and counting the
  selected tokens of [cu_seqlens[b], cu_seqlens[b+1]) in a fixed order: deterministic, no atomics.

Rows whose `active` flag is 0 (masked tokens) are skipped in the forward (their lse and target logit are 0).
Offsets are int64: row * stride exceeds int32 at N=32768, V=151936.

The kernels are jitted lazily, per value of `triton.knobs.runtime.interpret` (TRITON_INTERPRET), at the first
launch rather than at import: importing this module never fixes the mode, so a test that enables the
interpreter after something else imported triton still gets interpreted kernels on CPU.

Shape legend: N tokens, V vocab columns of this shard (or chunk), B sequences; `_N` [N], `_NV` [N, V],
`_B1` [B + 1].
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

_MAX_BLOCK_V = 4096
_SEGMENT_BLOCK = 1024
# FMA contraction, passed explicitly at launch: triton 3.9's implicit default, which triton 3.10 flips.
_FP_FUSION = True
# Finite "minus infinity" for the running max: exp(-inf - (-1e30)) = 0, whereas (-inf) - (-inf) would be NaN
# on a row (or shard) whose logits are all -inf.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
# Reductions call `tl.reduce` with triton's own combine functions instead of `tl.sum` / `tl.max`: those two
# are `@triton.jit` wrappers, frozen in compiled mode when triton is imported without TRITON_INTERPRET
# (megatron.core imports triton), and a compiled-mode function cannot be called from an interpreted kernel.
# `tl.reduce` is a builtin, and the interpreter recognises these two combine functions (numpy fast paths).
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


def _row_stats_kernel(
    logits_ptr,
    stride_logits,
    targets_ptr,
    active_ptr,
    lse_ptr,
    target_logit_ptr,
    V,
    vocab_start,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(active_ptr + row) != 0
    local_target = tl.load(targets_ptr + row).to(tl.int64) - vocab_start
    owned = active & (local_target >= 0) & (local_target < V)
    row_ptr = logits_ptr + row * stride_logits
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full((), _NEG_BIG, tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    loop_end = tl.where(active, V, 0)
    for start in range(0, loop_end, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temperature
        new_max = tl.maximum(running_max, tl.reduce(x, 0, _MAX))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.reduce(tl.exp(x - new_max), 0, _SUM)
        running_max = new_max
    lse = running_max + tl.log(tl.where(active, running_sum, 1.0))
    target_logit = tl.load(row_ptr + tl.where(owned, local_target, 0), mask=owned, other=0.0).to(tl.float32)
    tl.store(lse_ptr + row, tl.where(active, lse, 0.0))
    tl.store(target_logit_ptr + row, tl.where(owned, target_logit * inv_temperature, 0.0))


def _dlogits_kernel(
    logits_ptr,
    stride_logits,
    dlogits_ptr,
    stride_dlogits,
    targets_ptr,
    grad_ptr,
    lse_ptr,
    V,
    vocab_start,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    grad = tl.load(grad_ptr + row).to(tl.float32)
    lse = tl.load(lse_ptr + row).to(tl.float32)
    local_target = tl.load(targets_ptr + row).to(tl.int64) - vocab_start
    active = grad != 0.0
    scale = grad * inv_temperature
    in_ptr = logits_ptr + row * stride_logits
    out_ptr = dlogits_ptr + row * stride_dlogits
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, tl.where(active, V, 0), BLOCK_V):
        offs = start + cols
        inside = offs < V
        x = tl.load(in_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        prob = tl.exp(x * inv_temperature - lse)
        d = scale * (tl.where(offs == local_target, 1.0, 0.0) - prob)
        tl.store(out_ptr + offs, d.to(dlogits_ptr.dtype.element_ty), mask=inside)
    zeros = tl.full((BLOCK_V,), 0.0, dlogits_ptr.dtype.element_ty)
    for start in range(0, tl.where(active, 0, V), BLOCK_V):
        offs = start + cols
        tl.store(out_ptr + offs, zeros, mask=offs < V)


def _segment_sums_kernel(
    values_ptr,
    active_ptr,
    cu_seqlens_ptr,
    sums_ptr,
    counts_ptr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    cnt = tl.full((BLOCK,), 0, tl.int32)
    for offset in range(start, end, BLOCK):
        offs = offset + lanes
        inside = offs < end
        keep = (tl.load(active_ptr + offs, mask=inside, other=0) != 0) & inside
        acc += tl.where(keep, tl.load(values_ptr + offs, mask=keep, other=0.0), 0.0)
        cnt += keep.to(tl.int32)
    tl.store(sums_ptr + seq, tl.reduce(acc, 0, _SUM))
    tl.store(counts_ptr + seq, tl.reduce(cnt, 0, _SUM).to(tl.int64))


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The jitted kernels for one interpreter mode (`triton.jit` reads the mode when it wraps a function)."""
    del interpret  # the cache key; triton.jit reads triton.knobs.runtime.interpret itself
    return SimpleNamespace(
        row_stats=triton.jit(_row_stats_kernel),
        dlogits=triton.jit(_dlogits_kernel),
        segment_sums=triton.jit(_segment_sums_kernel),
    )


def _current_kernels() -> SimpleNamespace:
    return _kernels(bool(triton.knobs.runtime.interpret))


def _block_v(V: int, block_v: int | None) -> int:
    if block_v is not None:
        if block_v <= 0 or block_v & (block_v - 1):
            raise ValueError(f"block_v={block_v} must be a positive power of two")
        return block_v
    return min(_MAX_BLOCK_V, triton.next_power_of_2(V))


def _num_warps(block_v: int) -> int:
    return 16 if block_v >= 4096 else 8 if block_v >= 1024 else 4


def row_stats(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    active_N: torch.Tensor,
    vocab_start: int,
    inv_temperature: float,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local log-sum-exp of `logits/T` and owned target logit `/T` per row (0 for inactive rows).

    `logits_NV` may be any float dtype with unit stride along V; `active_N` is a uint8 flag per row. Returns
    two fp32 [N] tensors. The target logit is 0 where the target id is outside [vocab_start, vocab_start + V).
    """
    N, V = logits_NV.shape
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    target_logit_N = torch.empty_like(lse_N)
    if N == 0:
        return lse_N, target_logit_N
    block = _block_v(V, block_v)
    _current_kernels().row_stats[(N,)](
        logits_NV,
        logits_NV.stride(0),
        targets_N,
        active_N,
        lse_N,
        target_logit_N,
        V,
        vocab_start,
        inv_temperature,
        BLOCK_V=block,
        num_warps=_num_warps(block),
        enable_fp_fusion=_FP_FUSION,
    )
    return lse_N, target_logit_N


def dlogits(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    grad_N: torch.Tensor,
    lse_N: torch.Tensor,
    vocab_start: int,
    inv_temperature: float,
    out_NV: torch.Tensor,
    *,
    block_v: int | None = None,
) -> None:
    """Writes grad * (onehot(target) - softmax(logits/T)) / T into `out_NV` (which may alias `logits_NV`).

    `lse_N` is the global (all-shard) log-sum-exp saved by the forward; `grad_N` is the folded fp32 upstream
    gradient per token (0 for masked tokens, whose rows are zero-filled without reading the logits).
    """
    N, V = logits_NV.shape
    if N == 0:
        return
    block = _block_v(V, block_v)
    _current_kernels().dlogits[(N,)](
        logits_NV,
        logits_NV.stride(0),
        out_NV,
        out_NV.stride(0),
        targets_N,
        grad_N,
        lse_N,
        V,
        vocab_start,
        inv_temperature,
        BLOCK_V=block,
        num_warps=_num_warps(block),
        enable_fp_fusion=_FP_FUSION,
    )


def segment_sums(
    values_N: torch.Tensor, active_N: torch.Tensor, cu_seqlens_B1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sum of `values_N` (fp32) and count of active tokens (int64) over `cu_seqlens_B1`.

    One program per sequence walks its tokens in order: the result is bitwise reproducible (no atomics).
    """
    B = cu_seqlens_B1.numel() - 1
    sums_B = torch.empty(B, dtype=torch.float32, device=values_N.device)
    counts_B = torch.empty(B, dtype=torch.int64, device=values_N.device)
    if B == 0:
        return sums_B, counts_B
    _current_kernels().segment_sums[(B,)](
        values_N,
        active_N,
        cu_seqlens_B1,
        sums_B,
        counts_B,
        BLOCK=_SEGMENT_BLOCK,
        num_warps=4,
        enable_fp_fusion=_FP_FUSION,
    )
    return sums_B, counts_B


class TritonLogprobOps:
    """`LogprobOps` on the Triton kernels (compiled on CUDA, interpreted on CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def row_stats(self, logits_NV, targets_N, active_N, vocab_start, inv_temperature, overwrite=False):
        del overwrite  # the kernel never writes its input
        return row_stats(logits_NV, targets_N, active_N, vocab_start, inv_temperature)

    def dlogits(self, logits_NV, targets_N, grad_N, lse_N, vocab_start, inv_temperature, out_NV):
        dlogits(logits_NV, targets_N, grad_N, lse_N, vocab_start, inv_temperature, out_NV)

    def segment_sums(self, values_N, active_N, cu_seqlens_B1):
        return segment_sums(values_N, active_N, cu_seqlens_B1)
