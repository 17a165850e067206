"""Triton kernels for per-token / per-sequence log-probs (REFERENCE.md §5), and their launchers.

Three kernels, all on a 1-D launch grid (axis 0 allows 2**31 - 1 programs, so N >= 65536 tokens is fine;
grid axes 1 and 2 overflow at 65535):

- `_row_stats_kernel`: one program per token row. Online softmax over vocab blocks of `logits/T` in fp32
  with a per-lane state: each of the BLOCK_V lanes keeps its own running (max, sum-exp) over the columns it
  sees, so the loop body is purely elementwise (one exp per element: of exp(m - m') and exp(x - m') one is
  exp(0) = 1); the lanes are reduced once after the loop (max, then sum of sum_l * exp(m_l - max)). Plus the
  row's target logit `/T` when this shard owns the target id.
- `_dlogits_kernel`: one program per row. d logits = g * (onehot - exp(logits/T - lse)) / T from the saved
  lse (no recompute of the statistics); rows with g == 0 (masked tokens) only write zeros. May run in place.
- `_segment_sums_kernel`: one program per sequence, summing the masked token log-probs and counting the
  selected tokens of [cu_seqlens[b], cu_seqlens[b+1]) in a fixed order: deterministic, no atomics.

Block size and warps of the two row kernels are a fixed function of the vocab width V (`row_config`, one entry
of `ROW_CONFIGS` per width range), the same compiled or interpreted, for both kernels and in every run. Not
autotuned: the block sets how each row's lanes split the columns, hence the order of the log-sum-exp's
additions, so a block chosen by timing changed the bits of the log-probs from run to run (and across the TP
ranks of one run); and a width is tuned once per distinct value -- a run meets hundreds (vocab chunks of the
fused LM head, packed micro-batch shapes) -- while the other TP ranks wait in the next collective. The row pass
is memory bound: past a few thousand columns the block changes its time by a few percent.

Rows whose `active` flag is 0 (masked tokens) are skipped in the forward (their lse and target logit are 0).
Offsets are int64: row * stride exceeds int32 at N=16384, V=151936 (2.49e9 elements) -- `program_id` is cast
before it is multiplied; the column offsets within a row stay int32 (V < 2**31).

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

from megatron_gspo.kernels.triton_version import require_triton

triton = require_triton()
import triton.language as tl  # noqa: E402  (after the version check, which names the fix)

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

ROW_CONFIGS = (
    # (widest V of the range, BLOCK_V, num_warps)
    (1024, 1024, 4),
    (4096, 2048, 4),
    (16384, 4096, 8),
    (None, 8192, 16),
)
"""The row kernels' configuration per vocab-width range, narrowest first: a block no wider than the rows need
(at least 1024), and registers per thread (BLOCK_V / (32 * num_warps) lanes) kept at 8-16."""


def row_config(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernels for rows of V columns: a pure function of V (`ROW_CONFIGS`)."""
    for widest, block, warps in ROW_CONFIGS:
        if widest is None or V <= widest:
            return block, warps
    raise AssertionError("ROW_CONFIGS ends with an open range")


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
    lane_max = tl.full((BLOCK_V,), _NEG_BIG, tl.float32)
    lane_sum = tl.full((BLOCK_V,), 0.0, tl.float32)
    loop_end = tl.where(active, V, 0)
    for start in range(0, loop_end, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temperature
        # Per lane: sum <- sum * exp(m - m') + exp(x - m') with m' = max(m, x). One of the two exponents is
        # 0, the other is -|x - m|: one exp per element (x = -inf, a masked column, adds exp(-inf) = 0).
        grows = x > lane_max
        e = tl.exp(-tl.abs(x - lane_max))
        lane_sum = tl.where(grows, lane_sum * e + 1.0, lane_sum + e)
        lane_max = tl.maximum(lane_max, x)
    # Once per row: lanes that never saw a finite value hold (-1e30, 0) and add 0 * exp(-1e30 - max) = 0.
    row_max = tl.reduce(lane_max, 0, _MAX)
    row_sum = tl.reduce(lane_sum * tl.exp(lane_max - row_max), 0, _SUM)
    lse = row_max + tl.log(tl.where(active, row_sum, 1.0))
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
    """The jitted kernels for one interpreter mode (`triton.jit` reads the mode when it wraps a function); the
    row kernels take BLOCK_V and num_warps at launch (`row_config`)."""
    del interpret  # the cache key; triton.jit reads triton.knobs.runtime.interpret itself
    return SimpleNamespace(
        row_stats=triton.jit(_row_stats_kernel),
        dlogits=triton.jit(_dlogits_kernel),
        segment_sums=triton.jit(_segment_sums_kernel),
    )


def _current_kernels() -> SimpleNamespace:
    return _kernels(bool(triton.knobs.runtime.interpret))


def _check_block(block_v: int) -> int:
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a positive power of two")
    return block_v


def _num_warps(block_v: int) -> int:
    """The warps of an explicitly chosen block: those of the widest ROW_CONFIGS entry with a block <= it."""
    fitting = [warps for _, block, warps in ROW_CONFIGS if block <= block_v]
    return fitting[-1] if fitting else ROW_CONFIGS[0][2]


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
    `block_v` fixes the block (num_warps follows from it) instead of `row_config(V)`.
    """
    N, V = logits_NV.shape
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    target_logit_N = torch.empty_like(lse_N)
    if N == 0:
        return lse_N, target_logit_N
    kernels = _current_kernels()
    block, warps = row_config(V) if block_v is None else (_check_block(block_v), _num_warps(block_v))
    kernels.row_stats[(N,)](
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
        num_warps=warps,
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
    Block and warps: `block_v`, else `row_config(V)` (the statistics kernel's).
    """
    N, V = logits_NV.shape
    if N == 0:
        return
    kernels = _current_kernels()
    block, warps = row_config(V) if block_v is None else (_check_block(block_v), _num_warps(block_v))
    kernels.dlogits[(N,)](
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
        num_warps=warps,
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
