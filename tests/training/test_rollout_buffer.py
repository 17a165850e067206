"""The rollout buffer between the rollout stage and the training stage: which groups a batch gets, in which order,
what is dropped and counted, and the weight versions (staleness) of what is taken."""

import pytest
import torch

from megatron_gspo.data.types import PromptItem
from megatron_gspo.rollout.types import Rollout
from megatron_gspo.training.rollout_buffer import RolloutBuffer, RolloutGroup, group_version


def group(name: str, rewards, version: int = 0) -> RolloutGroup:
    return RolloutGroup(PromptItem(name, "0"), [], torch.tensor(rewards, dtype=torch.float32), version)


def names(groups) -> list[str]:
    return [g.item.prompt for g in groups]


def test_informative_groups_first_in_production_order_then_zero_variance_fill():
    buf = RolloutBuffer()
    buf.put([group("f1", [0, 0]), group("i1", [0, 1]), group("f2", [1, 1]), group("i2", [1, 0]), group("f3", [0, 0])])
    taken = buf.take(4, version=0)
    assert names(taken.groups) == ["i1", "i2", "f1", "f2"]
    assert (taken.zero_variance_kept, taken.dropped, taken.stale) == (2, 1, 0)
    assert taken.staleness == [0, 0, 0, 0]
    assert len(buf) == 0  # synchronous: nothing is left for the next step


def test_a_group_varies_only_when_its_rewards_differ():
    assert group("a", [0.5, 0.5, 0.5]).informative is False
    assert group("b", [0.5, 0.5, 0.25]).informative is True


def test_surplus_informative_groups_wait_for_the_next_batch():
    buf = RolloutBuffer(max_staleness=1)
    buf.put([group("i1", [0, 1]), group("i2", [0, 1]), group("i3", [0, 1]), group("f1", [0, 0])])
    first = buf.take(2, version=0)
    assert names(first.groups) == ["i1", "i2"] and first.dropped == 1
    buf.put([group("f2", [1, 1], version=1)])
    second = buf.take(2, version=1)
    assert names(second.groups) == ["i3", "f2"]
    assert second.staleness == [1, 0]


def test_a_short_batch_is_refused_not_taken():
    # Every data-parallel rank must hold as many sequences: a smaller batch would leave collectives unmatched.
    buf = RolloutBuffer()
    buf.put([group("i1", [0, 1]), group("f1", [0, 0])])
    assert not buf.ready(3, version=0)
    with pytest.raises(RuntimeError, match="fewer than the 3 a rollout batch needs"):
        buf.take(3, version=0)
    assert buf.ready(2, version=0) and len(buf.take(2, version=0).groups) == 2


def test_groups_older_than_max_staleness_are_dropped_and_counted():
    buf = RolloutBuffer(max_staleness=1)
    buf.put([group("old", [0, 1], version=3), group("ok", [0, 1], version=4), group("flat", [1, 1], version=3),
             group("new", [1, 1], version=5)])
    assert not buf.ready(3, version=5)
    taken = buf.take(2, version=5)
    assert names(taken.groups) == ["ok", "new"]
    assert taken.stale == 2 and taken.staleness == [1, 0]


def test_without_a_bound_nothing_is_stale_and_staleness_is_still_reported():
    buf = RolloutBuffer()
    buf.put([group("a", [0, 1], version=7), group("b", [0, 0], version=2)])
    taken = buf.take(2, version=7)
    assert names(taken.groups) == ["a", "b"] and taken.stale == 0
    assert taken.staleness == [0, 5]


def test_a_zero_bound_keeps_only_the_current_version():
    buf = RolloutBuffer(max_staleness=0)
    buf.put([group("a", [0, 1], version=7), group("b", [0, 0], version=6), group("c", [1, 1], version=7)])
    taken = buf.take(2, version=7)
    assert names(taken.groups) == ["a", "c"] and taken.stale == 1


def test_a_group_has_the_oldest_weight_version_of_its_rollouts():
    # A rollout continued across a weight update reports its oldest tokens' version (engines set it per rollout).
    rollouts = [Rollout(prompt_ids=[1], response_ids=[2], logprobs=[0.0], finish_reason="stop", weight_version=v)
                for v in (4, 3, 4)]
    assert group_version(rollouts) == 3
    with pytest.raises(ValueError, match="at least one rollout"):
        group_version([])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_staleness_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutBuffer(max_staleness=bad)
