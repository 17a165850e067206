"""`megatron-gspo plan` counts what the trainer allocates: its parameters per rank, the fp32 main-grad buffer (not
sharded) and the distributed optimizer's fp32 masters + Adam moments, sharded over data-parallel ranks (dense
params over DP, experts over expert-DP). Checked against the trainer's own default set-up on 2 gloo ranks with
EP=2 (dense state sharded over DP=2, experts over expert-DP=1) for the tiny preset."""

import pytest

from megatron_gspo.models.config import preset
from megatron_gspo.planning.memory import Layout, MemoryAssumptions, stage_parameters
from tests.distributed import run_distributed
from tests.planning.trainer_terms_ranks import trainer_memory_terms


@pytest.fixture(scope="module")
def ep2():
    return run_distributed(trainer_memory_terms, dict(ep=2), world_size=2)


def test_planner_parameters_grads_and_sharded_optimizer_are_the_trainers(ep2):
    layout = Layout(tp=1, pp=1, ep=2, etp=1, dp=2)
    dense, expert = stage_parameters(preset("tiny"), layout, 0, MemoryAssumptions())
    for rank in ep2:
        assert rank["distributed"] is True  # the planner's "distributed optimizer" is the trainer's default
        assert (rank["dense"], rank["expert"]) == (dense, expert)
        # grads: 4 bytes x params, unsharded (megatron pads each buffer to a multiple of the DP size x 128)
        assert rank["grad_dtypes"] == {"torch.float32"}
        assert 0 <= rank["grad_elements"] - (dense + expert) <= 2 * 128 * layout.dp
        # optimizer: 12 bytes x (dense / DP + expert / expert-DP) of fp32 master + Adam m, v
    assert sum(r["dense_masters"] for r in ep2) == dense  # every dense element once over the 2 DP ranks
    for rank in ep2:
        assert rank["dense_masters"] == pytest.approx(dense / layout.dp, abs=128 * layout.dp)
        assert rank["expert_masters"] == expert // layout.expert_dp


@pytest.mark.parametrize("vocab, tp", [(32, 1), (32, 2), (151936, 2), (151936, 8), (151937, 4)])
def test_planner_pads_the_vocabulary_as_the_trainer_does(vocab, tp):
    from megatron_gspo.models.build import padded_vocab_size
    from megatron_gspo.planning.memory import padded_vocab

    assert padded_vocab(vocab, tp, MemoryAssumptions().vocab_divisible_by) == padded_vocab_size(vocab, tp)
