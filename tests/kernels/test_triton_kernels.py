"""The Triton launchers directly (interpreted): small vocab blocks, in-place d logits, segment sums."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.kernels import triton_logprob
from megatron_gspo.kernels.segments import segment_sums_torch
from megatron_gspo.kernels.torch_logprob import dlogits_torch, row_stats_torch

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _inputs(N=9, V=300, vocab_start=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=gen) * 4
    # About a third of the targets fall in this shard's [vocab_start, vocab_start + V); rows 0-2 hit the
    # edges: the first owned id, the last owned id, the first id past the shard.
    targets = torch.randint(0, 3 * V, (N,), generator=gen)
    targets[:3] = torch.tensor([vocab_start, vocab_start + V - 1, vocab_start + V])
    active = (torch.rand(N, generator=gen) > 0.25).to(torch.uint8)
    active[:3] = 1
    return logits, targets, active


@pytest.mark.parametrize("block_v", [32, 128, 512])
def test_row_stats_online_over_blocks(block_v):
    """V=300 spans 10 / 3 / 1 blocks, the last one partial: the online (max, sum-exp) merge matches torch."""
    logits, targets, active = _inputs()
    lse, target = triton_logprob.row_stats(logits, targets, active, 100, 1 / 0.6, block_v=block_v)
    ref_lse, ref_target = row_stats_torch(logits, targets, active, 100, 1 / 0.6)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(target, ref_target)
    assert target[2] == 0 and target[0] != 0 and target[1] != 0
    assert (lse[active == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dlogits_in_place(dtype):
    logits, targets, active = _inputs()
    logits = logits.to(dtype)
    lse, _ = row_stats_torch(logits, targets, torch.ones_like(active), 100, 0.5)
    grad = torch.randn(logits.shape[0]) * active
    expected = torch.empty_like(logits)
    dlogits_torch(logits, targets, grad, lse, 100, 0.5, expected)
    work = logits.clone()
    triton_logprob.dlogits(work, targets, grad, lse, 100, 0.5, work, block_v=64)  # overwrite its own input
    torch.testing.assert_close(work, expected)
    assert (work[active == 0] == 0).all()


def test_segment_sums_long_sequences():
    """Sequences longer than the 1024-token block; sums match float64 ones, counts are exact."""
    gen = torch.Generator().manual_seed(1)
    values = -torch.rand(5000, generator=gen) * 10
    active = (torch.rand(5000, generator=gen) > 0.2).to(torch.uint8)
    cu = torch.tensor([0, 2500, 2500, 2501, 4999], dtype=torch.int32)  # token 4999 is padding
    sums, counts = triton_logprob.segment_sums(values, active, cu)
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    exact = torch.tensor([float((values[s:e].double() * active[s:e]).sum()) for s, e in spans])
    torch.testing.assert_close(sums, exact.float(), rtol=1e-6, atol=1e-3)
    assert counts.tolist() == [int(active[s:e].sum()) for s, e in spans]
    assert counts[1] == 0
    ref_sums, ref_counts = segment_sums_torch(values, active, cu)
    torch.testing.assert_close(sums, ref_sums, rtol=1e-6, atol=1e-3)
    assert torch.equal(counts, ref_counts)


def _stats_cases(dtype):
    """Rows that stress the per-lane online softmax: the max in a late block and another lane, a huge
    dynamic range, -inf columns, a whole -inf row (a vocab-padding shard), a masked row."""
    gen = torch.Generator().manual_seed(3)
    V = 8192 + 1024 + 77  # not a multiple of any block: 2 to 10 blocks, the last one partial
    logits = torch.randn(6, V, generator=gen) * 3
    logits[0, V - 5] = 40.0  # max in the partial last block
    logits[1] *= 30  # exp underflows for most columns
    logits[2, ::3] = float("-inf")
    logits[3] = float("-inf")
    logits[4, 17] = 25.0  # max in the first block, lane 17
    targets = torch.tensor([V - 5, 0, 2, 4, 17, 9]) + 50
    active = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.uint8)
    return logits.to(dtype), targets, active, V


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # the -inf row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v", [None] + sorted({block for _, block, _ in triton_logprob.ROW_CONFIGS}))
def test_row_stats_every_config_matches_float64(dtype, block_v):
    """Every block of ROW_CONFIGS (and the default path) against a float64 log-sum-exp."""
    logits, targets, active, V = _stats_cases(dtype)
    lse, target = triton_logprob.row_stats(logits, targets, active, 50, 1 / 0.7, block_v=block_v)
    z = logits.double() / 0.7
    expected = torch.logsumexp(z, dim=1).float()
    expected[active == 0] = 0
    torch.testing.assert_close(lse[:3], expected[:3], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lse[4], expected[4], rtol=1e-6, atol=1e-5)
    assert lse[3] == float("-inf") and lse[5] == 0  # an all -inf row has lse -inf (exp(lse) = 0), no NaN
    rows = torch.arange(6)
    expected_target = z[rows, targets - 50].float()
    torch.testing.assert_close(target[:5], expected_target[:5])
    assert target[5] == 0


class _Launches:
    """Stands in for the jitted kernels: records (kernel, BLOCK_V, num_warps) of each launch."""

    def __init__(self):
        self.seen = []

    def kernel(self, name):
        outer = self

        class Launcher:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: outer.seen.append(
                    (name, kwargs.get("BLOCK_V"), kwargs.get("num_warps"))
                )

        return Launcher()


# Widths at each range's edges, a Qwen3 vocab shard per TP size, and chunk-like widths in between.
WIDTHS = [1, 32, 1024, 1025, 3000, 4096, 4097, 16384, 16385, 37984, 75968, 151936]


def test_compiled_row_kernels_launch_one_fixed_config_per_width(monkeypatch):
    """Compiled mode (the GPU's path, its launches recorded here): for every width, the statistics and the d
    logits kernels launch with row_config(V) -- no autotuner, whose timing-chosen block changed the
    log-sum-exp's bits between runs -- whatever the dtype, the call order or what ran before; and the config is
    a step function of the width range. The kernels' launchers are recorded instead of run: compiled Triton
    needs a GPU (this CPU runs only the interpreter); the real compiled launches run in tools/gpu_smoke.sh
    (part `kernels`)."""
    launches = _Launches()
    kernels = {name: launches.kernel(name) for name in ("row_stats", "dlogits", "segment_sums")}
    from types import SimpleNamespace

    monkeypatch.setattr(triton_logprob, "_current_kernels", lambda: SimpleNamespace(**kernels))
    # The knob reads the variable (setting the knob itself would leave an override behind for later tests).
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for order in (WIDTHS, WIDTHS[::-1]):
        for V in order:
            for dtype in (torch.bfloat16, torch.float32):
                logits = torch.zeros(2, V, dtype=dtype)
                targets, flags = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.uint8)
                launches.seen.clear()
                lse, _ = triton_logprob.row_stats(logits, targets, flags, 0, 1.0)
                triton_logprob.dlogits(logits, targets, torch.ones(2), lse, 0, 1.0, torch.empty_like(logits))
                block, warps = triton_logprob.row_config(V)
                assert launches.seen == [("row_stats", block, warps), ("dlogits", block, warps)], (V, dtype)
    configs = [triton_logprob.row_config(V) for V in WIDTHS]
    assert configs[:3] == [(1024, 4)] * 3 and configs[3:6] == [(2048, 4)] * 3
    assert configs[6:8] == [(4096, 8)] * 2 and configs[8:] == [(8192, 16)] * 4


def test_row_stats_bits_repeat_for_a_width():
    """The same rows give the same bits on every call, with the default config equal to row_config's block."""
    logits, targets, active = _inputs(N=5, V=3000)
    first = triton_logprob.row_stats(logits, targets, active, 100, 1.0)
    again = triton_logprob.row_stats(logits, targets, active, 100, 1.0)
    explicit = triton_logprob.row_stats(
        logits, targets, active, 100, 1.0, block_v=triton_logprob.row_config(3000)[0]
    )
    for a, b, c in zip(first, again, explicit):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_dlogits_default_config_matches_torch():
    """Without block_v the d logits kernel runs row_config(V) and matches the torch reference."""
    logits, targets, active = _inputs(V=3000)
    lse, _ = row_stats_torch(logits, targets, torch.ones_like(active), 100, 1.0)
    grad = torch.randn(logits.shape[0])
    expected = torch.empty_like(logits)
    dlogits_torch(logits, targets, grad, lse, 100, 1.0, expected)
    out = torch.empty_like(logits)
    triton_logprob.dlogits(logits, targets, grad, lse, 100, 1.0, out)
    torch.testing.assert_close(out, expected)


def test_row_offsets_past_int32():
    """Row offsets row * stride beyond 2**31 elements (N=16384 x V=151936 has 2.49e9): a 3-row view with a row
    stride of 2**30 + 64 (an int32 stride, as triton types it) puts row 2 at element 2**31 + 128. The storage is
    4 GiB of virtual memory of which only the three rows are ever touched (and the interpreter's copy-back of a
    CPU storage onto itself is a no-op), so this runs on a laptop."""
    stride, V = 2**30 + 64, 300
    storage = torch.empty(2 * stride + V, dtype=torch.bfloat16)
    view = storage.as_strided((3, V), (stride, 1))
    gen = torch.Generator().manual_seed(4)
    compact = (torch.randn(3, V, generator=gen) * 3).bfloat16()
    view.copy_(compact)
    targets = torch.tensor([5, 299, 150])
    active = torch.ones(3, dtype=torch.uint8)
    lse, target = triton_logprob.row_stats(view, targets, active, 0, 1.0)
    ref_lse, ref_target = row_stats_torch(compact, targets, active, 0, 1.0)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(target, ref_target)
    grad = torch.tensor([1.0, -2.0, 0.5])
    expected = torch.empty_like(compact)
    dlogits_torch(compact, targets, grad, ref_lse, 0, 1.0, expected)
    triton_logprob.dlogits(view, targets, grad, ref_lse, 0, 1.0, view)  # in place, through the same offsets
    torch.testing.assert_close(view.clone(), expected)
