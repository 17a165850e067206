"""HF tensor validation: every problem named, in one error."""

import pytest
import torch

from megatron_gspo.models.hf_state import canonical_hf_state_dict, check_hf_state_dict, hf_tensor_shapes
from tests.models.parity import hf_state_dict, tiny_config


def test_fused_transformers_experts_become_checkpoint_names():
    cfg = tiny_config()
    sd = canonical_hf_state_dict(hf_state_dict(cfg))
    assert set(sd) == set(hf_tensor_shapes(cfg))
    check_hf_state_dict(cfg, sd)


def test_missing_extra_and_misshaped_tensors_are_listed():
    cfg = tiny_config()
    sd = canonical_hf_state_dict(hf_state_dict(cfg))
    del sd["model.layers.2.mlp.experts.3.up_proj.weight"]
    sd["model.layers.9.mlp.gate.weight"] = torch.zeros(8, 128)
    sd["model.norm.weight"] = torch.zeros(64)
    with pytest.raises(ValueError) as err:
        check_hf_state_dict(cfg, sd)
    text = str(err.value)
    assert "1 tensor missing: model.layers.2.mlp.experts.3.up_proj.weight" in text
    assert "unexpected: model.layers.9.mlp.gate.weight" in text
    assert "model.norm.weight (64,) (expected (128,))" in text
