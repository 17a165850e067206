"""Minibatches of whole groups in a seeded order with the informative groups dealt evenly: dynamic sampling puts
the zero-variance fillers last, and contiguous minibatches would then step Adam on zero-advantage groups only."""

import pytest

from megatron_gspo.batching.batch import minibatch_group_order
from tests.distributed import run_distributed
from tests.training.trainer_ranks import collect_steps


def test_group_order_is_a_seeded_permutation_dealing_informative_groups_evenly():
    for informative in range(9):
        order = minibatch_group_order(informative, 8, 4, seed=(1, 2))
        assert sorted(order) == list(range(8))  # every group once, whole
        assert order == minibatch_group_order(informative, 8, 4, seed=(1, 2))
        counts = [sum(i < informative for i in order[k * 2 : (k + 1) * 2]) for k in range(4)]
        assert max(counts) - min(counts) <= 1, (informative, order)
    orders = {tuple(minibatch_group_order(4, 8, 4, seed=(1, step))) for step in range(6)}
    assert len(orders) > 1  # reshuffled from step to step
    # Groups that do not divide into the minibatches: a plain seeded permutation.
    assert sorted(minibatch_group_order(2, 6, 4, seed=0)) == list(range(6))
    with pytest.raises(ValueError, match="num_informative=9"):
        minibatch_group_order(9, 8, 4, seed=0)


def test_no_minibatch_holds_only_zero_advantage_groups(tmp_path):
    """8 prompts, 4 with reward variance, no top-up: the 4 zero-variance fillers must not form two minibatches."""
    out = run_distributed(collect_steps, str(tmp_path / "run"), [
        "rollout.dynamic_sampling=true", "rollout.max_topup_rounds=0", "trainer.minibatches=4",
    ], 2, "by_position", world_size=1)[0]
    for step in out["steps"]:
        assert step["stats"]["groups_zero_variance_kept"] == 4
        for adv in step["minibatch_advantages"]:
            assert adv.abs().max() > 0, [a.tolist() for a in step["minibatch_advantages"]]
