"""linear_sequence_logprobs equals sequence_logprobs(hidden @ weight.T) in values and gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.kernels import linear_sequence_logprobs, sequence_logprobs
from megatron_gspo.kernels.chunked_linear import vocab_chunk_size
from tests.kernels.cases import make_case, weighted_loss

_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _inputs(dtype, N, H=24, V=1000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, targets


def _grads(fn, hidden, weight, case, need=(True, True)):
    h = hidden.clone().requires_grad_(need[0])
    w = weight.clone().requires_grad_(need[1])
    out = fn(h, w)
    weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
def test_linear_equals_unfused(backend, dtype, masked):
    case = make_case([5, 0, 8, 3], vocab=1, mask_prob=0.4 if masked else None, temperature=0.8, pad_tokens=1)
    hidden, weight, targets = _inputs(dtype, case.targets.shape[0])
    cu, mask, kwargs = case.cu_seqlens, case.loss_mask, dict(temperature=0.8, backend=backend)

    def fused(h, w):  # chunk_size 384 over V = 1000: chunks of 384, 384 and a partial 232
        return linear_sequence_logprobs(h, w, targets, cu, mask, chunk_size=384, **kwargs)

    def unfused(h, w):
        return sequence_logprobs(h @ w.t(), targets, cu, mask, **kwargs)

    out, dh, dw = _grads(fused, hidden, weight, case)
    ref, ref_dh, ref_dw = _grads(unfused, hidden, weight, case)
    tol = _TOL[dtype]
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs, **tol)
    torch.testing.assert_close(out.seq_sum, ref.seq_sum, **tol)
    assert torch.equal(out.seq_count, ref.seq_count)
    assert dh.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(dh.float(), ref_dh.float(), **tol)
    torch.testing.assert_close(dw.float(), ref_dw.float(), **tol)
    if masked:
        assert (dh[~mask] == 0).all()


def test_weight_grad_only_and_hidden_grad_only(backend):
    case = make_case([4, 6], vocab=1)
    hidden, weight, targets = _inputs(torch.float32, 10, V=300)

    cu, mask = case.cu_seqlens, case.loss_mask

    def fused(h, w):
        return linear_sequence_logprobs(h, w, targets, cu, mask, backend=backend, chunk_size=128)

    _, ref_dh, ref_dw = _grads(fused, hidden, weight, case)
    _, dh_none, dw = _grads(fused, hidden, weight, case, need=(False, True))
    _, dh, dw_none = _grads(fused, hidden, weight, case, need=(True, False))
    assert dh_none is None and dw_none is None
    torch.testing.assert_close(dw, ref_dw)
    torch.testing.assert_close(dh, ref_dh)


def test_forward_only_saves_nothing(backend):
    case = make_case([3, 5], vocab=1)
    hidden, weight, targets = _inputs(torch.float32, 8, V=200)
    packs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(1) or t, lambda t: t):
        with torch.no_grad():
            out = linear_sequence_logprobs(
                hidden.requires_grad_(), weight, targets, case.cu_seqlens, case.loss_mask, backend=backend
            )
    assert not packs and out.token_logprobs.grad_fn is None
    ref = sequence_logprobs(hidden @ weight.t(), targets, case.cu_seqlens, case.loss_mask, backend="torch")
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs)


def test_all_tokens_masked_gives_zero_grads():
    case = make_case([3, 2], vocab=1)
    hidden, weight, targets = _inputs(torch.float32, 5, V=50)
    mask = torch.zeros(5, dtype=torch.bool)

    def fused(h, w):
        return linear_sequence_logprobs(h, w, targets, case.cu_seqlens, mask)

    out, dh, dw = _grads(fused, hidden, weight, case)
    assert out.seq_count.tolist() == [0, 0] and (out.seq_sum == 0).all()
    assert (dh == 0).all() and (dw == 0).all()


def test_default_chunk_fits_the_budget():
    assert vocab_chunk_size(4096, 151936, device_type="cpu") == 4096  # 4096 x 4096 x 4 B = 64 MiB
    assert vocab_chunk_size(32768, 151936, device_type="cuda") == 4096  # 512 MiB
    assert vocab_chunk_size(10, 1000) == 1000
    assert vocab_chunk_size(10**7, 151936) == 128  # never below one aligned block
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_chunk_size(10, 100, requested=0)


def test_bad_input_names_the_problem():
    hidden, weight, targets = _inputs(torch.float32, 4, V=20)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="weight"):
        linear_sequence_logprobs(hidden, weight[:, :5], targets, cu)
    with pytest.raises(ValueError, match="weight"):
        linear_sequence_logprobs(hidden, weight.double(), targets, cu)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_sequence_logprobs(hidden, weight, targets, cu, chunk_size=0)


def test_bf16_dhidden_accumulates_in_fp32():
    """d hidden over 32 vocab chunks, each partial large and the total small (nearly equal LM-head rows): with
    a bf16 product per chunk the rounding of every partial survives in the sum (median 37 bf16 ulps off,
    measured); accumulated in fp32 the result is the exact sum rounded once.

    Torch backend only: the accumulation is shared, and Triton's interpreter truncates fp32 -> bf16 stores
    (`cast_impl` ignores the rounding mode) where compiled Triton rounds to nearest even, which biases the
    interpreted bf16 d logits by far more than what this test measures."""
    backend = "torch"
    gen = torch.Generator().manual_seed(7)
    N, H, V, C = 16, 32, 4096, 128
    base = torch.randn(H, generator=gen)
    weight = (base + 0.01 * torch.randn(V, H, generator=gen)).bfloat16()
    hidden = (torch.randn(N, H, generator=gen) * 0.05).bfloat16()
    targets = torch.randint(0, V, (N,), generator=gen)
    cu = torch.tensor([0, N], dtype=torch.int32)
    h = hidden.clone().requires_grad_()
    linear_sequence_logprobs(
        h, weight, targets, cu, chunk_size=C, backend=backend
    ).token_logprobs.sum().backward()
    # Reference: the same bf16 logits chunks and bf16 d logits (the kernel's roundings), summed in float64.
    chunks = [hidden @ weight[v : v + C].t() for v in range(0, V, C)]
    lse = torch.logsumexp(torch.cat(chunks, 1).double(), 1)
    ref = torch.zeros(N, H, dtype=torch.float64)
    for i, logits in enumerate(chunks):
        d = -(logits.double() - lse[:, None]).exp()
        cols = targets - i * C
        own = (cols >= 0) & (cols < C)
        d[own.nonzero().squeeze(1), cols[own]] += 1.0
        ref += d.bfloat16().double() @ weight[i * C : (i + 1) * C].double()
    err = (h.grad.double() - ref).abs()
    ulp = ref.abs().float().bfloat16().double() * 2**-8
    assert (err / ulp).median() <= 1.0
    assert err.max() <= 0.01 * ref.abs().max()
