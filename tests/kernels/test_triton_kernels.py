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
