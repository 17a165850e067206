"""Rollouts -> training tensors: which label positions count, padding never does."""

import pytest
import torch

from megatron_gspo.batching.batch import pack_rollouts
from megatron_gspo.rollout.types import Rollout
from megatron_gspo.training.evaluate import pass_at_k


def _rollout(prompt, response, finish="stop"):
    return Rollout(prompt_ids=prompt, response_ids=response, logprobs=[-0.5] * len(response), finish_reason=finish)


def test_response_positions_include_the_stop_token_and_exclude_padding():
    rollouts = [_rollout([5, 6, 7], [8, 1]), _rollout([5, 6], [9, 9, 9], "length")]
    batch = pack_rollouts(rollouts, seq_len=6, pad_id=0, rewards=torch.tensor([1.0, 0.0]), advantages=torch.zeros(2))
    assert batch.tokens_NL.tolist() == [[5, 6, 7, 8, 1, 0, 0], [5, 6, 9, 9, 9, 0, 0]]
    # Label t predicts tokens[t + 1]: response tokens of row 0 are labels 2 (8) and 3 (1, the stop token).
    assert batch.loss_mask_NS.tolist() == [
        [False, False, True, True, False, False],
        [False, True, True, True, False, False],
    ]
    labels = batch.tokens_NL[:, 1:]
    assert labels[batch.loss_mask_NS].tolist() == [8, 1, 9, 9, 9]
    assert batch.engine_logprobs_NS[batch.loss_mask_NS].tolist() == [-0.5] * 5
    assert batch.engine_logprobs_NS[~batch.loss_mask_NS].abs().sum() == 0
    assert batch.response_lens_N.tolist() == [2, 3]


def test_too_long_rollout_is_refused():
    with pytest.raises(ValueError, match="raise rollout.max_new_tokens"):
        pack_rollouts([_rollout([1, 2, 3], [4, 5, 6])], seq_len=4, pad_id=0,
                      rewards=torch.zeros(1), advantages=torch.zeros(1))


def test_split_and_rows_keep_alignment():
    rollouts = [_rollout([5, 6], [i + 2]) for i in range(6)]
    batch = pack_rollouts(rollouts, seq_len=3, pad_id=0, rewards=torch.arange(6.0), advantages=torch.arange(6.0))
    parts = batch.split(3)
    assert [p.rewards_N.tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert parts[2].tokens_NL[:, 2].tolist() == [6, 7]
    with pytest.raises(ValueError, match="do not split into 4"):
        batch.split(4)


def test_pass_at_k_matches_the_combinatorial_definition():
    from itertools import combinations

    n, c = 6, 2
    samples = [1] * c + [0] * (n - c)
    for k in (1, 2, 3, 6):
        combos = list(combinations(samples, k))
        expected = sum(any(x) for x in combos) / len(combos)
        assert pass_at_k(n, c, k) == pytest.approx(expected)
    assert pass_at_k(4, 0, 2) == 0.0


def _reference_pack(rollouts, seq_len, pad_id, token_advantages=None):
    """Row by row, element by element: what pack_rollouts must return (tokens, loss mask, engine log-probs, token
    advantages), built without tensor slicing."""
    n = len(rollouts)
    tokens = [[pad_id] * (seq_len + 1) for _ in range(n)]
    mask = [[False] * seq_len for _ in range(n)]
    lp = [[0.0] * seq_len for _ in range(n)]
    adv = [[0.0] * seq_len for _ in range(n)]
    for i, r in enumerate(rollouts):
        for j, t in enumerate(list(r.prompt_ids) + list(r.response_ids)):
            tokens[i][j] = t
        for j in range(len(r.response_ids)):
            col = len(r.prompt_ids) - 1 + j  # label col predicts token col + 1
            mask[i][col] = True if r.loss_mask is None else bool(r.loss_mask[j])
            lp[i][col] = r.logprobs[j]
            if token_advantages is not None:
                adv[i][col] = token_advantages[i][j]
    return tokens, mask, lp, adv


@pytest.mark.parametrize("multiturn", [False, True])
def test_packing_matches_an_element_by_element_reference(multiturn):
    import random

    rng = random.Random(7)
    seq_len, rollouts, token_adv = 12, [], []
    for i in range(40):
        p = rng.randint(1, 6)
        m = rng.randint(0, seq_len + 1 - p)
        r = Rollout(prompt_ids=[rng.randint(1, 30) for _ in range(p)],
                    response_ids=[rng.randint(1, 30) for _ in range(m)], logprobs=[-rng.random() * 3 for _ in range(m)], finish_reason="stop", weight_version=i % 3)
        if multiturn:
            r.loss_mask = [rng.randint(0, 1) for _ in range(m)]
        rollouts.append(r)
        token_adv.append([rng.gauss(0, 1) for _ in range(m)])
    token_adv = token_adv if multiturn else None
    batch = pack_rollouts(rollouts, seq_len, pad_id=0, rewards=torch.arange(40.0), advantages=torch.ones(40),
                          token_advantages=token_adv)
    tokens, mask, lp, adv = _reference_pack(rollouts, seq_len, 0, token_adv)
    assert torch.equal(batch.tokens_NL, torch.tensor(tokens, dtype=torch.long))
    assert torch.equal(batch.loss_mask_NS, torch.tensor(mask, dtype=torch.bool))
    assert torch.equal(batch.engine_logprobs_NS, torch.tensor(lp, dtype=torch.float32))
    assert batch.prompt_lens_N.tolist() == [len(r.prompt_ids) for r in rollouts]
    assert batch.response_lens_N.tolist() == [len(r.response_ids) for r in rollouts]
    assert batch.prompt_lens_N.dtype == batch.response_lens_N.dtype == torch.long
    assert batch.weight_version_N.tolist() == [i % 3 for i in range(40)]
    if multiturn:
        assert torch.equal(batch.extra["token_advantages_NS"], torch.tensor(adv, dtype=torch.float32))
    else:
        assert batch.extra == {}


def test_an_empty_batch_packs_to_empty_tensors():
    batch = pack_rollouts([], seq_len=5, pad_id=0, rewards=torch.zeros(0), advantages=torch.zeros(0))
    assert batch.tokens_NL.shape == (0, 6) and batch.loss_mask_NS.shape == (0, 5)
    assert batch.engine_logprobs_NS.shape == (0, 5) and batch.prompt_lens_N.shape == (0,)
