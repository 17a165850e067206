"""Compiled Triton kernels on a CUDA device (skipped on CPU; run by tools/gpu_smoke.sh).

Shapes that matter on the cluster: N=16384 tokens x V=151936 (Qwen3's vocabulary) in bf16 is 2.49e9 logits,
past 2**31 elements (int64 offsets), past the 65535 grid-dimension limit (1-D grid); forward-only; the fused LM
head; and vocab-parallel TP=2 over NCCL on 2 GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.kernels import linear_sequence_logprobs, reference_sequence_logprobs, sequence_logprobs
from tests.distributed import run_distributed

pytestmark = pytest.mark.gpu

N_BIG, V_QWEN = 16384, 151936


def _close_by_rows(a: torch.Tensor, b: torch.Tensor, rows: int = 2048, **tol) -> None:
    """assert_close over row slices: no fp32 copy of a whole [N, V] pair at once."""
    for r in range(0, a.shape[0], rows):
        torch.testing.assert_close(a[r : r + rows].float(), b[r : r + rows].float(), **tol)


def _big_case(seed: int = 0, n: int = N_BIG, v: int = V_QWEN):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
    for r in range(0, n, 2048):  # filled in slices: no fp32 [N, V] temporary
        logits[r : r + 2048] = torch.randn(min(2048, n - r), v, device="cuda", generator=gen) * 3
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    lens = torch.tensor([0, n // 2, 1, n // 4, n - n // 2 - 1 - n // 4], device="cuda")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device="cuda")
    cu[1:] = lens.cumsum(0)
    mask = torch.rand(n, device="cuda", generator=gen) > 0.3
    return logits, targets, cu, mask


def test_past_2_31_logits_match_reference_in_place():
    """16384 x 151936 bf16 (2.49e9 elements): values, gradients (written in place over non-leaf logits) and
    the fixed row config for V=151936, against the fp32 log_softmax + gather oracle."""
    from megatron_gspo.kernels import triton_logprob

    logits, targets, cu, mask = _big_case()
    assert logits.numel() > 2**31
    w_tok = torch.randn(N_BIG, device="cuda")
    w_seq = torch.randn(cu.numel() - 1, device="cuda")
    leaf = logits.clone().requires_grad_()
    ours = leaf * 1.0  # a non-leaf, like the LM head's output: the backward overwrites it with d logits
    storage = ours.data_ptr()
    seen = []
    ours.register_hook(lambda g: seen.append(g.data_ptr()))
    out = sequence_logprobs(ours, targets, cu, mask, temperature=0.8, backend="triton")
    ((out.token_logprobs * w_tok).sum() + (out.seq_sum * w_seq).sum()).backward()
    assert seen == [storage]
    assert triton_logprob.row_config(V_QWEN) == (8192, 16)
    ref_logits = logits.requires_grad_()
    ref = reference_sequence_logprobs(ref_logits, targets, cu, mask, temperature=0.8)
    ((ref[0] * w_tok).sum() + (ref[1] * w_seq).sum()).backward()
    torch.testing.assert_close(out.token_logprobs, ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.seq_sum, ref[1], rtol=1e-5, atol=2e-2)
    assert torch.equal(out.seq_count.cpu(), ref[2])
    _close_by_rows(leaf.grad, ref_logits.grad, rtol=2e-2, atol=1e-3)


def test_forward_only_at_scale_allocates_only_outputs():
    """no_grad at 16384 x 151936 bf16: matches the fp32 oracle, allocates O(N) (no [N, V] buffer), saves
    nothing, and is deterministic run to run."""
    logits, targets, cu, mask = _big_case(seed=1)
    with torch.no_grad():  # compilation happens here, not below
        sequence_logprobs(logits, targets, cu, mask, backend="triton")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = sequence_logprobs(logits, targets, cu, mask, backend="triton")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 64 * 2**20
    assert out.token_logprobs.grad_fn is None
    again = sequence_logprobs(logits, targets, cu, mask, backend="triton")
    assert torch.equal(again.seq_sum, out.seq_sum) and torch.equal(again.token_logprobs, out.token_logprobs)
    with torch.no_grad():
        ref = reference_sequence_logprobs(logits, targets, cu, mask)
    torch.testing.assert_close(out.token_logprobs, ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.seq_sum, ref[1], rtol=1e-5, atol=2e-2)


def test_cuda_addmm_accumulates_bf16_products_into_fp32():
    """torch 2.13 documents addmm(input, mat1, mat2, out_dtype, *, out=) for fp32 out with bf16 / fp16 inputs
    on CUDA only; `accumulate_fp32` relies on it taking an fp32 `input` (older CUDA kernels required the
    matrices' dtype). Checks both that and the fp32 result."""
    from megatron_gspo.kernels.chunked_linear import _cuda_addmm_out_dtype, accumulate_fp32

    assert _cuda_addmm_out_dtype(), (
        "this torch's CUDA addmm.dtype_out refuses an fp32 input with bf16 matrices"
    )
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(512, 4096, device="cuda", generator=gen).bfloat16()
    b = torch.randn(4096, 256, device="cuda", generator=gen).bfloat16()
    acc = torch.full((512, 256), 3.0, device="cuda")
    accumulate_fp32(acc, a, b)
    exact = 3.0 + a.double() @ b.double()
    torch.testing.assert_close(acc.double(), exact, rtol=1e-5, atol=1e-3)


def test_fused_linear_at_scale_matches_unfused():
    """The fused LM head at N=16384, H=1024, V=151936 bf16 (chunks of 4096) against materialised bf16 logits
    + the kernel, values and both gradients."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    n, h_dim = N_BIG, 1024
    hidden = torch.randn(n, h_dim, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V_QWEN, h_dim, device="cuda", generator=gen) / h_dim**0.5).bfloat16()
    targets = torch.randint(0, V_QWEN, (n,), device="cuda", generator=gen)
    cu = torch.tensor([0, 5000, 12000, n], dtype=torch.int32, device="cuda")
    mask = torch.rand(n, device="cuda", generator=gen) > 0.5
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            out = linear_sequence_logprobs(h, w, targets, cu, mask, backend="triton", chunk_size=4096)
        else:
            out = sequence_logprobs(h @ w.t(), targets, cu, mask, backend="triton")
        (out.token_logprobs.sum() + out.seq_sum.sum()).backward()
        results.append((out.token_logprobs.detach(), h.grad, w.grad))
        del out, h, w
    torch.testing.assert_close(results[0][0], results[1][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_triton_matches_reference_at_70000_tokens():
    """N > 65535 (1-D grid) with V not a multiple of any block."""
    logits, targets, cu, mask = _big_case(seed=3, n=70000, v=4100)
    ours = logits.clone().requires_grad_()
    out = sequence_logprobs(ours, targets, cu, mask, temperature=0.8, backend="triton")
    out.seq_sum.sum().backward()
    ref_logits = logits.clone().requires_grad_()
    ref = reference_sequence_logprobs(ref_logits, targets, cu, mask, temperature=0.8)
    ref[1].sum().backward()
    torch.testing.assert_close(out.token_logprobs, ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours.grad.float(), ref_logits.grad.float(), rtol=2e-2, atol=1e-3)


def _tp2_worker(n: int, v: int) -> dict:
    """Rank r of TP=2 over NCCL on GPU r: its vocab half of the big case (uneven split), values + d logits."""
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    logits, targets, cu, mask = _big_case(seed=4, n=n, v=v)
    split = v // 2 + 1
    lo, hi = (0, split) if rank == 0 else (split, v)
    shard = logits[:, lo:hi].contiguous().requires_grad_()
    out = sequence_logprobs(
        shard * 1.0, targets, cu, mask, tp_group=dist.group.WORLD, vocab_start_index=lo, backend="triton"
    )
    out.seq_sum.sum().backward()
    return dict(out=[t.cpu() for t in out], grad=shard.grad.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_equals_unsharded():
    n, v = 8192, V_QWEN
    ranks = run_distributed(_tp2_worker, n, v, world_size=2)
    logits, targets, cu, mask = _big_case(seed=4, n=n, v=v)
    ref_logits = logits.requires_grad_()
    ref = reference_sequence_logprobs(ref_logits, targets, cu, mask)
    ref[1].sum().backward()
    for rank in ranks:
        torch.testing.assert_close(rank["out"][0], ref[0].cpu(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(rank["out"][1], ref[1].cpu(), rtol=1e-5, atol=2e-2)
    grad = torch.cat([ranks[0]["grad"], ranks[1]["grad"]], dim=1)
    _close_by_rows(grad, ref_logits.grad.cpu(), rtol=2e-2, atol=1e-3)
