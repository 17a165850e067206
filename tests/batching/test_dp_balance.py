"""Balanced token counts over data-parallel replicas: each minibatch's sequences are re-dealt between two gloo
ranks (one holding long responses, one short), every sequence lands on exactly one rank with its tensors, its
Rollout and its routes, each rank keeps as many sequences per minibatch as before, and the token counts even out."""

import pytest
import torch

from tests.batching.balance_ranks import MINIBATCHES, PER_RANK, balanced_rows, rank_batch
from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(balanced_rows, world_size=2)


def test_every_sequence_moves_with_its_data(ranks):
    seen = set()
    for got in ranks:
        assert got["tokens"].shape[0] == PER_RANK and got["seq_index"].tolist() == list(range(PER_RANK))
        for row, ro in enumerate(got["rollouts"]):
            src_rank, src_row = ro.prompt_ids[0] - 100, ro.prompt_ids[1] - 1
            seen.add((src_rank, src_row))
            ref = rank_batch(src_rank)
            for key, name in (("tokens", "tokens_NL"), ("mask", "loss_mask_NS"), ("engine", "engine_logprobs_NS"),
                              ("rewards", "rewards_N"), ("adv", "advantages_N"), ("response_lens", "response_lens_N")):
                assert torch.equal(got[key][row], getattr(ref, name)[src_row]), (key, src_rank, src_row)
            assert int(ro.routed_experts[0, 0, 0]) == 10 * src_rank + src_row
            # Minibatch structure: a sequence stays in its minibatch.
            per = PER_RANK // MINIBATCHES
            assert row // per == src_row // per
    assert seen == {(r, i) for r in range(2) for i in range(PER_RANK)}


def test_token_counts_even_out(ranks):
    before = [got["input_tokens_before"] for got in ranks]
    after = [int((got["prompt_lens"] + got["response_lens"] - 1).sum()) for got in ranks]
    assert sum(after) == sum(before)
    assert abs(after[0] - after[1]) < 0.2 * abs(before[0] - before[1])
