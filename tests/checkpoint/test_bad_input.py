"""Bad Hugging Face input is rejected before anything is built or written, with an error listing what is wrong,
and nothing is left at the output directory."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_gspo.checkpoint.convert import convert_main, hf_to_megatron, megatron_to_hf
from megatron_gspo.models.config import preset
from megatron_gspo.models.hf_state import hf_tensor_shapes

CFG = preset("tiny", num_hidden_layers=4, num_experts=4)


def _hf_dir(path: Path, drop=(), add=None, reshape=None, config=None, shards: int = 3) -> Path:
    """A synthetic HF checkpoint for CFG (random data, several shards), optionally broken."""
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) for n, s in hf_tensor_shapes(CFG).items() if n not in drop}
    tensors.update(add or {})
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.zeros(shape)
    path.mkdir(parents=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), **(config or {})}))
    return path


def _rejects(tmp_path, hf: Path, *fragments: str) -> str:
    out = tmp_path / "out"
    with pytest.raises(ValueError) as info:
        hf_to_megatron(hf, out)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == [hf.name], "something was written next to --out"
    return message


def test_missing_tensor(tmp_path):
    hf = _hf_dir(tmp_path / "hf", drop=["model.layers.2.self_attn.k_proj.weight", "lm_head.weight"])
    _rejects(tmp_path, hf, "2 tensors missing", "model.layers.2.self_attn.k_proj.weight", "lm_head.weight")


def test_extra_tensor(tmp_path):
    name = "model.layers.0.mlp.shared_expert.up_proj.weight"
    hf = _hf_dir(tmp_path / "hf", add={name: torch.zeros(4, 128)})
    _rejects(tmp_path, hf, "1 tensor unexpected", name)


def test_wrong_shape(tmp_path):
    hf = _hf_dir(tmp_path / "hf", reshape={"model.layers.1.self_attn.q_proj.weight": (96, 128)})
    expected = "model.layers.1.self_attn.q_proj.weight (96, 128) (expected (128, 128))"
    _rejects(tmp_path, hf, "1 tensor with wrong shapes", expected)


def test_unsupported_architecture(tmp_path):
    hf = _hf_dir(tmp_path / "hf", config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    _rejects(tmp_path, hf, "'llama' checkpoints are not supported", "config.json")


def test_config_disagrees_with_weights(tmp_path):
    hf = _hf_dir(tmp_path / "hf", config={"num_hidden_layers": 6, "vocab_size": 40})
    message = _rejects(
        tmp_path,
        hf,
        "tensors missing",
        "model.layers.4.* (",
        "config.json says num_hidden_layers=6 but the weights have num_hidden_layers=4",
        "config.json says vocab_size=40 but the weights have vocab_size=32",
        "wrong shapes",
    )
    assert message.count("\n  - ") >= 4  # one line per problem


def test_cli_reports_bad_input_and_returns_2(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf", drop=["model.norm.weight"])
    assert convert_main(["hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "model.norm.weight" in err
    assert not (tmp_path / "out").exists()
    assert convert_main(["megatron-to-hf", "--ckpt", str(hf), "--out", str(tmp_path / "out")]) == 2
    assert "not a megatron-gspo model checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_main(["hf-to-megatron", "--hf", str(hf)])  # --out is required


def test_output_must_be_new_and_not_the_input(tmp_path):
    hf = _hf_dir(tmp_path / "hf")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        hf_to_megatron(hf, tmp_path / "taken")
    with pytest.raises(ValueError, match="is the input directory"):
        hf_to_megatron(hf, hf, overwrite=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        megatron_to_hf(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_to_megatron(tmp_path / "taken", tmp_path / "out")
