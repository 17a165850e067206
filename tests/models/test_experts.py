"""The local spec's experts without megatron's per-expert module calls (models/experts.py) compute exactly what
megatron's SequentialMLP computes: the same bits in the forward output and in every gradient (inputs, routing
probabilities, each expert's weights, an expert without tokens included), alone and inside a whole model, fp32
and bf16."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.models.experts_ranks import compare


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def results(request):
    return run_distributed(compare, request.param, world_size=1)[0]


def test_the_local_spec_builds_the_lean_experts_and_they_skip_megatrons_mlp_calls(results):
    assert results["is_expert_loop"] and results["lean"]
    for case in ("spread", "one_expert"):
        lean, reference = results[case]
        assert lean["mlp_calls"] == 0
        assert reference["mlp_calls"] > 0  # the reference really is megatron's per-expert loop


@pytest.mark.parametrize("case", ["spread", "one_expert"])
def test_experts_match_megatrons_loop_bit_for_bit(results, case):
    lean, reference = results[case]
    assert lean["bias"] is None and reference["bias"] is None
    keys = [k for k in reference if k not in ("bias", "mlp_calls")]
    assert any(k.startswith("w.") for k in keys)
    for key in keys:
        assert lean[key].dtype == reference[key].dtype, key
        assert torch.equal(lean[key], reference[key]), key
    # the comparison is not vacuous: real gradients everywhere they should be, zeros for experts without tokens
    assert reference["x"].abs().max() > 0 and reference["probs"].abs().max() > 0
    assert reference["w.local_experts.3.linear_fc1.weight"].abs().max() > 0
    assert torch.count_nonzero(reference["w.local_experts.1.linear_fc2.weight"]) == 0


def test_a_whole_model_has_the_same_loss_and_gradients(results):
    lean, reference = results["model"]
    assert torch.equal(lean["loss"], reference["loss"])
    experts = [k for k in reference if "local_experts" in k]
    assert experts and any(reference[k].abs().max() > 0 for k in experts)
    for key in reference:
        assert torch.equal(lean[key], reference[key]), key
