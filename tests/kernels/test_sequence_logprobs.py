"""sequence_logprobs (torch and interpreted Triton backends) against the fp32 log_softmax + gather oracle."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.kernels import reference_sequence_logprobs, sequence_logprobs
from megatron_gspo.kernels.backends import resolve_backend
from tests.kernels.cases import make_case, weighted_loss

CASES = {
    # V = 5000 is not a multiple of the 4096 vocab block: two blocks, the second partial.
    "several_seqs_masked_temperature": dict(seq_lens=[5, 0, 7, 9], vocab=5000, temperature=0.7),
    "bf16": dict(seq_lens=[6, 4, 3], vocab=1000, dtype=torch.bfloat16, temperature=1.3),
    "fp16": dict(seq_lens=[4, 5], vocab=333, dtype=torch.float16),
    "single_token": dict(seq_lens=[1], vocab=77, mask_prob=None),
    "empty_fully_masked_and_padding": dict(seq_lens=[0, 3, 0, 4], vocab=129, mask_prob=0.6, pad_tokens=2),
}
_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-3),
    torch.float16: dict(rtol=2e-3, atol=1e-4),
}


def _run(case, backend, **kwargs):
    logits = case.logits.clone().requires_grad_()
    kwargs = dict(temperature=case.temperature, backend=backend, **kwargs)
    out = sequence_logprobs(logits, case.targets, case.cu_seqlens, case.loss_mask, **kwargs)
    weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
    return out, logits.grad


def _reference(case):
    logits = case.logits.clone().requires_grad_()
    token, seq_sum, seq_count = reference_sequence_logprobs(
        logits, case.targets, case.cu_seqlens, case.loss_mask, temperature=case.temperature
    )
    weighted_loss(token, seq_sum, case).backward()
    return token, seq_sum, seq_count, logits.grad


@pytest.mark.parametrize("name", list(CASES))
def test_matches_fp32_reference(name, backend):
    case = make_case(**CASES[name])
    out, grad = _run(case, backend)
    ref_token, ref_sum, ref_count, ref_grad = _reference(case)
    assert out.token_logprobs.dtype == torch.float32 and out.seq_sum.dtype == torch.float32
    assert out.seq_count.dtype == torch.int64
    torch.testing.assert_close(out.token_logprobs, ref_token, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.seq_sum, ref_sum, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.seq_count, ref_count)
    assert grad.dtype == case.logits.dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), **_TOL[case.logits.dtype])
    if case.loss_mask is not None:
        masked = ~case.loss_mask
        assert (out.token_logprobs[masked] == 0).all() and (grad[masked] == 0).all()


def test_empty_and_fully_masked_sequences_give_zero(backend):
    case = make_case([3, 0, 4, 2], vocab=50)
    mask = torch.tensor([1, 1, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    out = sequence_logprobs(case.logits, case.targets, case.cu_seqlens, mask, backend=backend)
    assert out.seq_count.tolist() == [3, 0, 0, 1]
    assert out.seq_sum[1].item() == 0.0 and out.seq_sum[2].item() == 0.0
    assert out.seq_mean()[1:3].tolist() == [0.0, 0.0]
    assert (out.seq_sum[[0, 3]] < 0).all()


def test_minus_inf_padding_columns(backend):
    """Vocab padding filled with -inf (a whole block of it) changes nothing and produces no NaN."""
    case = make_case([4, 3], vocab=300, mask_prob=None)
    padded = torch.cat([case.logits, torch.full((7, 200), float("-inf"))], dim=1).requires_grad_()
    out = sequence_logprobs(padded, case.targets, case.cu_seqlens, backend=backend)
    weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
    ref_token, _, _, ref_grad = _reference(case)
    torch.testing.assert_close(out.token_logprobs, ref_token)
    torch.testing.assert_close(padded.grad[:, :300], ref_grad)
    assert (padded.grad[:, 300:] == 0).all()


def test_deterministic(backend):
    case = make_case([9, 4, 11], vocab=700, temperature=0.9)
    (a, grad_a), (b, grad_b) = _run(case, backend), _run(case, backend)
    for x, y in zip([*a, grad_a], [*b, grad_b]):
        assert torch.equal(x, y)


def test_ignores_targets_of_masked_tokens(backend):
    case = make_case([5, 5], vocab=64)
    targets = torch.where(case.loss_mask, case.targets, -100)
    a = sequence_logprobs(case.logits, targets, case.cu_seqlens, case.loss_mask, backend=backend)
    b = sequence_logprobs(case.logits, case.targets, case.cu_seqlens, case.loss_mask, backend=backend)
    torch.testing.assert_close(a.token_logprobs, b.token_logprobs, rtol=0, atol=0)


def test_non_contiguous_rows(backend):
    case = make_case([3, 4], vocab=90)
    wide = torch.randn(7, 200)
    wide[:, 10:100] = case.logits
    view = wide[:, 10:100]  # row stride 200, unit column stride: used as is
    out = sequence_logprobs(view, case.targets, case.cu_seqlens, case.loss_mask, backend=backend)
    ref = sequence_logprobs(case.logits, case.targets, case.cu_seqlens, case.loss_mask, backend="torch")
    torch.testing.assert_close(out.token_logprobs, ref.token_logprobs)


class _SaveCounter:
    def __init__(self):
        self.count = 0

    def pack(self, tensor):
        self.count += 1
        return tensor


@pytest.mark.parametrize("mode", ["no_grad", "no_requires_grad"])
def test_forward_only_saves_nothing(backend, mode):
    case = make_case([4, 6], vocab=100)
    counter = _SaveCounter()
    logits = case.logits.clone().requires_grad_(mode == "no_grad")
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
            out = sequence_logprobs(logits, case.targets, case.cu_seqlens, case.loss_mask, backend=backend)
    assert counter.count == 0 and out.token_logprobs.grad_fn is None
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        logits = case.logits.clone().requires_grad_()
        grad_out = sequence_logprobs(logits, case.targets, case.cu_seqlens, case.loss_mask, backend=backend)
    # The hook does see the saving call of the differentiable path.
    assert counter.count > 0 and grad_out.token_logprobs.grad_fn is not None
    torch.testing.assert_close(out.token_logprobs, grad_out.token_logprobs.detach(), rtol=0, atol=0)


def test_auto_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", torch.device("cpu")).name == "triton"
    assert resolve_backend("torch", torch.device("cpu")).name == "torch"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=torch.tensor([0, 4, 3, 7], dtype=torch.int32)), "non-decreasing"),
        (dict(cu_seqlens=torch.tensor([1, 7], dtype=torch.int32)), "start at 0"),
        (dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), "end at most"),
        (dict(temperature=0.0), "temperature"),
        (dict(targets=torch.zeros(6, dtype=torch.long)), "targets"),
        (dict(loss_mask=torch.ones(3)), "loss_mask"),
        (dict(backend="cuda"), "backend"),
        (dict(logits=torch.zeros(7, 5, dtype=torch.int32)), "logits"),
    ],
)
def test_bad_input_names_the_problem(kwargs, match):
    args = dict(
        logits=torch.zeros(7, 5),
        targets=torch.zeros(7, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 7], dtype=torch.int32),
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sequence_logprobs(**args)


def test_no_tokens_at_all(backend):
    logits = torch.zeros(0, 10, requires_grad=True)
    cu = torch.tensor([0, 0], dtype=torch.int32)
    out = sequence_logprobs(logits, torch.zeros(0, dtype=torch.long), cu, backend=backend)
    assert (
        out.token_logprobs.shape == (0,) and out.seq_sum.tolist() == [0.0] and out.seq_count.tolist() == [0]
    )
    out.seq_sum.sum().backward()
    assert logits.grad.shape == (0, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_writes_dlogits_over_nonleaf_logits(backend, dtype):
    """An LM head's output (a non-leaf) gets its gradient written in place: no second [N, V] buffer; the leaf
    upstream still receives the reference gradient."""
    case = make_case([5, 0, 7], vocab=900, dtype=dtype, temperature=0.8)
    source = case.logits.clone().requires_grad_()
    logits = source * 1.0  # non-leaf, as the output layer's logits are
    seen = []
    logits.register_hook(lambda g: seen.append((g.data_ptr(), g.dtype)))
    storage = logits.data_ptr()
    out = sequence_logprobs(
        logits, case.targets, case.cu_seqlens, case.loss_mask, temperature=0.8, backend=backend
    )
    weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
    assert seen == [(storage, dtype)]
    ref_token, _, _, ref_grad = _reference(case)
    torch.testing.assert_close(out.token_logprobs, ref_token, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(source.grad.float(), ref_grad.float(), **_TOL[dtype])


@pytest.mark.parametrize("leaf", [True, False])
def test_leaf_logits_and_opt_out_keep_their_values(backend, leaf):
    """A caller's leaf tensor is never overwritten; neither is a non-leaf with inplace_backward=False."""
    case = make_case([4, 6], vocab=300)
    logits = case.logits.clone().requires_grad_()
    if not leaf:
        logits = logits * 1.0
    before = logits.detach().clone()
    out = sequence_logprobs(
        logits, case.targets, case.cu_seqlens, case.loss_mask, backend=backend, inplace_backward=leaf
    )
    weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
    assert torch.equal(logits.detach(), before)


def test_inplace_backward_fails_loudly_for_another_user_of_the_logits(backend):
    """A node created earlier that saved the same logits runs after ours: torch's version check refuses it."""
    case = make_case([4, 6], vocab=300)
    logits = case.logits.clone().requires_grad_() * 1.0
    other = (logits * logits).sum()  # saves `logits` for its backward
    out = sequence_logprobs(logits, case.targets, case.cu_seqlens, case.loss_mask, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (weighted_loss(out.token_logprobs, out.seq_sum, case) + other).backward()


def test_old_triton_is_refused_with_the_fix(monkeypatch):
    """A triton without `triton.knobs` (3.3.1 and older) names the release to install, for every entry point."""
    import sys
    import types

    from megatron_gspo.kernels import triton_version

    old = types.ModuleType("triton")
    old.__version__ = "3.3.1"
    assert "pip install 'triton>=3.4.0'" in triton_version.triton_problem(old)
    assert triton_version.triton_problem(sys.modules["triton"]) is None  # the installed one is fine
    monkeypatch.setitem(sys.modules, "triton", old)
    monkeypatch.delitem(sys.modules, "megatron_gspo.kernels.triton_logprob")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(
        ValueError, match=r"triton 3\.3\.1 is older than 3\.4\.0.*pip install 'triton>=3\.4\.0'"
    ):
        resolve_backend("auto", torch.device("cpu"))
    with pytest.raises(ImportError, match="older than 3.4.0"):
        triton_version.require_triton()
