"""bf16 mixed precision on CPU, as on the cluster: bf16 params, fp32 main (master) params, fp32 main grads
(megatron's Float16OptimizerWithFloat16Params).

The optimizer clones its fp32 master weights when it is built; weights loaded afterwards (`model.load`, resume)
must reach the masters, or the first `step()` copies the random init back into the model. One step at a tiny
learning rate must leave the loaded weights as they were (within bf16 rounding) and move the masters by about
the learning rate.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.mixed_precision_ranks import TINY_LR, bf16_load_step_resume

BF16_REL = 2.0**-8
"""One bf16 ulp relative to the value (8 significand bits): loading rounds to nearest, within half of it."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(bf16_load_step_resume, str(tmp_path_factory.mktemp("bf16")), world_size=1, timeout=600)[0]


def _assert_preserved(result: dict, checkpoint: dict) -> None:
    precision = {k: v for k, v in result["precision"].items() if k != "device"}
    assert precision == {"params": {"torch.bfloat16"}, "main_params": {"torch.float32"}, "main_grads": {"torch.float32"}}
    assert result["adam"], "the optimizer step did not run (no Adam state)"
    assert set(result["weights"]) == set(checkpoint)
    moved = 0.0
    for name, loaded in checkpoint.items():
        torch.testing.assert_close(result["weights"][name].float(), loaded, rtol=BF16_REL, atol=1e-6, msg=name)
        # The masters start from the loaded bf16 weights and move by ~lr (Adam's first step is lr * sign(grad)).
        start = loaded.to(torch.bfloat16).float()
        torch.testing.assert_close(result["masters"][name], start, rtol=0, atol=3 * TINY_LR, msg=name)
        moved = max(moved, (result["masters"][name] - start).abs().max().item())
    assert moved > 0.5 * TINY_LR, "the masters did not take the step"


def _check_sft(runs):
    assert runs["sft"]["steps"] == 1
    assert runs["sft_masters_equal_model_before"], "the fp32 masters do not hold the loaded weights"
    _assert_preserved(runs["sft"], runs["checkpoint"])


def _check_rl(runs):
    assert runs["rl"]["steps"] == 1
    row = runs["rl"]["history"][0]
    assert row["skipped_steps"] == 0
    assert row["grad_norm"] > 0
    _assert_preserved(runs["rl"], runs["checkpoint"])


def _check_resume(runs):
    assert runs["resumed"]["step"] == 1
    for name, value in runs["rl"]["masters"].items():
        assert torch.equal(runs["resumed"]["masters"][name], value), name
        assert torch.equal(runs["resumed"]["weights"][name], runs["rl"]["weights"][name]), name


def test_sft_step_after_model_load_keeps_the_loaded_weights(runs):
    _check_sft(runs)


def test_rl_step_after_model_load_keeps_the_loaded_weights(runs):
    _check_rl(runs)


def test_bf16_resume_restores_weights_and_exact_masters(runs):
    _check_resume(runs)


@pytest.mark.gpu
def test_bf16_load_step_and_resume_on_cuda(runs):
    """The same on a GPU node (tools/gpu_smoke.sh part bf16-load): the run's tensors are on CUDA."""
    assert runs["sft"]["precision"]["device"] == {"cuda"} and runs["rl"]["precision"]["device"] == {"cuda"}
    _check_sft(runs)
    _check_rl(runs)
    _check_resume(runs)
