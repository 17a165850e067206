"""Model checkpoint format helpers that need no process group: config comparison, directory resolution,
format-version checks. (Saving and loading across layouts is covered in test_convert.py.)"""

import dataclasses
import json

import pytest

from megatron_gspo.checkpoint.model_io import (
    FORMAT_VERSION,
    config_differences,
    read_checkpoint_info,
    read_model_config,
    resolve_model_checkpoint,
)
from megatron_gspo.models.config import preset

CFG = preset("tiny")


def test_config_differences_name_fields_by_strictness():
    other = dataclasses.replace(
        CFG, hidden_size=64, rope_theta=5.0, router_aux_loss_coef=0.5, max_position_embeddings=1024
    )
    strict = config_differences(CFG, other)
    assert strict == ["hidden_size: checkpoint 128, model 64", "rope_theta: checkpoint 10000.0, model 5.0"]
    assert config_differences(CFG, other, strict=False) == ["hidden_size: checkpoint 128, model 64"]
    assert config_differences(CFG, dataclasses.replace(CFG, router_aux_loss_coef=0.5)) == []


def _fake_checkpoint(root, info=None):
    (root / "model").mkdir(parents=True)
    (root / "model" / "metadata.json").write_text("{}")
    (root / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    if info is not None:
        (root / "megatron_gspo.json").write_text(json.dumps(info))
    return root


def test_resolve_accepts_iteration_dirs_and_the_model_subdir(tmp_path):
    ck = _fake_checkpoint(tmp_path / "run" / "iter_0000002", info={"format_version": FORMAT_VERSION})
    (ck / "trainer_state.json").write_text("{}")
    assert resolve_model_checkpoint(ck) == ck
    assert resolve_model_checkpoint(ck / "model") == ck
    assert read_model_config(ck / "model") == CFG
    with pytest.raises(FileNotFoundError, match=r"missing config.json, model/metadata.json.*iter_0000002"):
        resolve_model_checkpoint(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_checkpoint(tmp_path / "nowhere")


def test_newer_format_and_bad_config_are_rejected(tmp_path):
    ck = _fake_checkpoint(tmp_path / "a", info={"format_version": FORMAT_VERSION + 1})
    with pytest.raises(ValueError, match="newer than this megatron-gspo reads"):
        read_checkpoint_info(ck)
    assert read_checkpoint_info(_fake_checkpoint(tmp_path / "b")) == {}
    bad = _fake_checkpoint(tmp_path / "c")
    (bad / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), "num_experts_per_tok": 99}))
    with pytest.raises(ValueError, match="not a valid model config.*num_experts_per_tok=99"):
        read_model_config(bad)
