"""TP=2 over gloo: vocab-sharded log-probs equal the unsharded ones (values, gradients); one collective."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_gspo.kernels import linear_sequence_logprobs, reference_sequence_logprobs, sequence_logprobs
from tests.distributed import run_distributed
from tests.kernels.cases import make_case, weighted_loss

VOCAB, SPLIT, HIDDEN = 1001, 500, 16  # uneven shards: [0, 500) and [500, 1001)
CASE = dict(seq_lens=[4, 0, 6, 3], vocab=VOCAB, temperature=0.9, seed=5)
_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
    "reduce_scatter_tensor",
    "broadcast",
)


def _linear_inputs():
    gen = torch.Generator().manual_seed(11)
    n_tokens = sum(CASE["seq_lens"])
    return torch.randn(n_tokens, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) / 4


def _count_collectives() -> dict[str, int]:
    counts = dict.fromkeys(_COLLECTIVES, 0)
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:  # all_gather_single is new in torch 2.10
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def _tp_worker() -> dict:
    os.environ["TRITON_INTERPRET"] = "1"  # this child only: the Triton backend runs interpreted on CPU
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, VOCAB)
    case = make_case(**CASE)
    counts = _count_collectives()
    tp = dict(temperature=case.temperature, tp_group=dist.group.WORLD, vocab_start_index=lo)
    results: dict = {}
    for backend in ("torch", "triton"):
        logits = case.logits[:, lo:hi].clone().requires_grad_()
        before = dict(counts)
        out = sequence_logprobs(logits, case.targets, case.cu_seqlens, case.loss_mask, backend=backend, **tp)
        weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
        calls = {name: counts[name] - before[name] for name in counts}
        results[backend] = dict(out=tuple(out), grad=logits.grad, calls=calls)
    hidden_full, weight_full = _linear_inputs()
    hidden = hidden_full.clone().requires_grad_()
    weight = weight_full[lo:hi].clone().requires_grad_()
    out = linear_sequence_logprobs(
        hidden, weight, case.targets, case.cu_seqlens, case.loss_mask, chunk_size=128, **tp
    )
    weighted_loss(out.token_logprobs, out.seq_sum, case).backward()
    results["linear"] = dict(out=tuple(out), dhidden_partial=hidden.grad, dweight=weight.grad)
    return results


def test_tp2_equals_unsharded():
    ranks = run_distributed(_tp_worker, world_size=2)
    case = make_case(**CASE)
    logits = case.logits.clone().requires_grad_()
    ref = reference_sequence_logprobs(logits, case.targets, case.cu_seqlens, case.loss_mask, temperature=0.9)
    weighted_loss(ref[0], ref[1], case).backward()
    for backend in ("torch", "triton"):
        for rank in ranks:
            token, seq_sum, seq_count = rank[backend]["out"]
            torch.testing.assert_close(token, ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(seq_sum, ref[1], rtol=1e-5, atol=1e-4)
            assert torch.equal(seq_count, ref[2])
            # Forward + backward: exactly one collective (the packed [N, 2] all_gather), none in the backward.
            calls = rank[backend]["calls"]
            assert sum(calls.values()) == 1, calls
            assert calls["all_gather_single"] + calls["all_gather_into_tensor"] == 1, calls
        grad = torch.cat([ranks[0][backend]["grad"], ranks[1][backend]["grad"]], dim=1)
        torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-6)

    hidden_full, weight_full = _linear_inputs()
    hidden, weight = hidden_full.clone().requires_grad_(), weight_full.clone().requires_grad_()
    unsharded = sequence_logprobs(
        hidden @ weight.t(), case.targets, case.cu_seqlens, case.loss_mask, temperature=0.9, backend="torch"
    )
    weighted_loss(unsharded.token_logprobs, unsharded.seq_sum, case).backward()
    for rank in ranks:
        torch.testing.assert_close(rank["linear"]["out"][0], unsharded.token_logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank["linear"]["out"][1], unsharded.seq_sum, rtol=1e-5, atol=1e-4)
    # d hidden: each rank returns its partial sum; the TP all-reduce (the caller's) completes it.
    dhidden = ranks[0]["linear"]["dhidden_partial"] + ranks[1]["linear"]["dhidden_partial"]
    torch.testing.assert_close(dhidden, hidden.grad, rtol=1e-5, atol=1e-5)
    dweight = torch.cat([ranks[0]["linear"]["dweight"], ranks[1]["linear"]["dweight"]], dim=0)
    torch.testing.assert_close(dweight, weight.grad, rtol=1e-5, atol=1e-5)
