"""Sampling math of the local engine (rollout/local/sampling.py) and its batch planning (rollout/local/decode.py)."""

import pytest
import torch

from megatron_gspo.rollout.local.decode import plan_batches
from megatron_gspo.rollout.local.sampling import filter_logits, sample_tokens


def _logits(rows=6, vocab=11, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_with_untempered_logprob():
    logits = _logits()
    tokens, logp = sample_tokens(logits, temperature=0.0, generator=_gen())
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, expected)


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_top_k_one_and_tiny_top_p_are_greedy(kwargs):
    logits = _logits(rows=64, seed=1)
    for seed in range(3):
        tokens, logp = sample_tokens(logits, temperature=0.7, generator=_gen(seed), **kwargs)
        assert torch.equal(tokens, logits.argmax(-1))
        # the log-prob is that of the temperature-scaled, untruncated distribution (not 0 = log 1)
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logp, expected)
        assert (logp < -1e-3).any()


def _frequencies(logits_V, draws, **kwargs):
    rows = logits_V.expand(draws, -1)
    tokens, logp = sample_tokens(rows, generator=_gen(7), **kwargs)
    return torch.bincount(tokens, minlength=logits_V.numel()).float() / draws, tokens, logp


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_follows_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq, tokens, logp = _frequencies(logits, 40_000, temperature=temperature)
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max() < 0.012, (freq, expected)
    torch.testing.assert_close(logp, torch.log(expected)[tokens])


def test_temperature_changes_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    cold, _, _ = _frequencies(logits, 20_000, temperature=0.5)
    hot, _, _ = _frequencies(logits, 20_000, temperature=2.0)
    assert cold[0] > hot[0] + 0.2
    assert hot[-1] > cold[-1] + 0.05


def test_top_k_keeps_k_tokens_and_renormalises():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq, tokens, logp = _frequencies(logits, 30_000, temperature=1.0, top_k=2)
    assert set(tokens.tolist()) == {0, 1}
    expected = torch.softmax(logits[:2], -1)
    assert (freq[:2] - expected).abs().max() < 0.012
    # reported log-probs ignore the truncation
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[tokens])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(filter_logits(logits, top_p=p))[0].nonzero().squeeze(-1).tolist()  # noqa: E731
    assert kept(0.4) == [0]  # mass above token 1 is 0.5 > 0.4
    assert kept(0.7) == [0, 1]  # mass above token 2 is 0.8 > 0.7
    assert kept(0.85) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]
    # order in the vocabulary does not matter
    perm = torch.tensor([2, 0, 3, 1])
    got = torch.isfinite(filter_logits(logits[:, perm], top_p=0.7))[0]
    assert got.tolist() == [False, True, False, True]


def test_top_k_and_top_p_intersect_on_the_full_distribution():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.7)).sum() == 2
    assert torch.isfinite(filter_logits(logits, top_k=1, top_p=0.9)).sum() == 1


def test_private_generator_is_reproducible_and_leaves_global_rng_alone():
    logits = _logits(rows=32)
    state = torch.get_rng_state()
    a, _ = sample_tokens(logits, temperature=1.0, top_p=0.9, generator=_gen(3))
    b, _ = sample_tokens(logits, temperature=1.0, top_p=0.9, generator=_gen(3))
    c, _ = sample_tokens(logits, temperature=1.0, top_p=0.9, generator=_gen(4))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)


def test_plan_batches_buckets_by_length_and_respects_max_batch_size():
    prompts = [[1] * 3, [1] * 5, [1] * 3, [1] * 3, [1] * 5]
    plans = plan_batches(prompts, n=4, max_batch_size=6)
    assert all(p.rows <= 6 for p in plans)
    for p in plans:
        assert len({len(prompts[i]) for i in p.prompt_indices}) == 1
    rows = {}
    for p in plans:
        for i, c in zip(p.prompt_indices, p.counts):
            rows[i] = rows.get(i, 0) + c
    assert rows == {i: 4 for i in range(5)}
    # samples of one prompt stay together when they fit
    assert [(p.prompt_indices, p.counts) for p in plan_batches(prompts, n=2, max_batch_size=6)] == [
        ([0, 2, 3], [2, 2, 2]),
        ([1, 4], [2, 2]),
    ]
