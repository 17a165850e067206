"""The fused log-prob path under megatron's overlapped param all-gather (issue 25, item 1).

The fused path reads `output_layer.weight` without calling the output layer, so DDP's forward pre-hook on that
module -- the only wait for its bucket's asynchronous all-gather under `overlap_param_gather` -- has to be run by
the model (models/gpt.py). Without it, with the LM head in its own bucket, the second minibatch computes with a
gather in flight and the third one trips megatron's `param_gather_handle is None` assertion
(param_and_grad_buffer.py:270); with two, the LM head's rows updated on the other rank miss the last step.
2 gloo ranks (DP=2), bf16 params with fp32 masters, 3 optimizer steps: after the forced gather every rank's LM
head equals the fp32 masters (gathered from both ranks' shards) rounded to bf16, as does every other weight."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.overlap_fused_ranks import overlapped_minibatches


def _check(ranks: list[dict]) -> None:
    for r in ranks:
        master = r["lm_head_master"].to(torch.bfloat16).float()
        torch.testing.assert_close(r["lm_head"], master, atol=0, rtol=0)
        assert r["other_max_diff"] == 0.0
    torch.testing.assert_close(ranks[0]["lm_head"], ranks[1]["lm_head"], atol=0, rtol=0)


def test_fused_path_with_overlapped_param_gather_three_steps():
    _check(run_distributed(overlapped_minibatches, 3, world_size=2))


def test_fused_path_with_overlapped_param_gather_two_steps_one_micro_batch():
    """Two steps of one micro-batch each do not assert: there the LM head's rows from the other rank silently
    missed the last update."""
    _check(run_distributed(overlapped_minibatches, 2, 4, world_size=2))


@pytest.mark.gpu
def test_fused_path_with_overlapped_param_gather_on_cuda():
    """tools/gpu_smoke.sh part `overlap`: one rank on CUDA (NCCL; the gathers are asynchronous CUDA work there),
    4 steps -- the issue's reproduction, which asserted at the third -- then the LM head equals its masters."""
    (rank,) = run_distributed(overlapped_minibatches, 4, world_size=1)
    torch.testing.assert_close(
        rank["lm_head"], rank["lm_head_master"].to(torch.bfloat16).float(), atol=0, rtol=0
    )
    assert rank["other_max_diff"] == 0.0
