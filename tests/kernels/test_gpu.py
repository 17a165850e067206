"""Compiled Triton kernels on a CUDA device (skipped on CPU): a shape past the 65535 grid-dimension limit."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.kernels import linear_sequence_logprobs, reference_sequence_logprobs, sequence_logprobs

pytestmark = pytest.mark.gpu


def test_triton_matches_reference_at_70000_tokens():
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, V = 70000, 4100  # N > 65535 (1-D grid), V not a multiple of the 4096 block
    logits = (torch.randn(N, V, device="cuda", generator=gen) * 3).bfloat16()
    targets = torch.randint(0, V, (N,), device="cuda", generator=gen)
    lens = torch.tensor([0, 30000, 1, 25000, 14999], device="cuda")
    cu = torch.zeros(6, dtype=torch.int32, device="cuda")
    cu[1:] = lens.cumsum(0)
    mask = torch.rand(N, device="cuda", generator=gen) > 0.3
    w_tok = torch.randn(N, device="cuda", generator=gen)
    w_seq = torch.randn(5, device="cuda", generator=gen)

    ours = logits.clone().requires_grad_()
    out = sequence_logprobs(ours, targets, cu, mask, temperature=0.8, backend="triton")
    ((out.token_logprobs * w_tok).sum() + (out.seq_sum * w_seq).sum()).backward()
    ref_logits = logits.clone().requires_grad_()
    ref = reference_sequence_logprobs(ref_logits, targets, cu, mask, temperature=0.8)
    ((ref[0] * w_tok).sum() + (ref[1] * w_seq).sum()).backward()

    torch.testing.assert_close(out.token_logprobs, ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.seq_sum, ref[1], rtol=1e-5, atol=1e-2)
    assert torch.equal(out.seq_count.cpu(), ref[2])
    torch.testing.assert_close(ours.grad.float(), ref_logits.grad.float(), rtol=2e-2, atol=1e-3)
    again = sequence_logprobs(logits, targets, cu, mask, temperature=0.8, backend="triton")
    assert torch.equal(again.seq_sum, out.seq_sum)  # deterministic run to run


def test_fused_linear_matches_unfused_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(1)
    N, H, V = 4096, 512, 20000
    hidden = torch.randn(N, H, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    targets = torch.randint(0, V, (N,), device="cuda", generator=gen)
    cu = torch.tensor([0, 1000, 4000, 4096], dtype=torch.int32, device="cuda")
    mask = torch.rand(N, device="cuda", generator=gen) > 0.5
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            out = linear_sequence_logprobs(h, w, targets, cu, mask, backend="triton", chunk_size=4096)
        else:
            out = sequence_logprobs(h @ w.t(), targets, cu, mask, backend="torch")
        (out.token_logprobs.sum() + out.seq_sum.sum()).backward()
        results.append((out.token_logprobs, h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
