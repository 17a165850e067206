"""Streaming safetensors I/O: the lazy reader reads only what is looked up; the writer flushes shards as tensors
arrive, respects the shard size, and leaves nothing at the output directory when it fails."""

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_gspo.checkpoint.convert import parse_size
from megatron_gspo.checkpoint.hf_io import HFCheckpointReader, write_hf_checkpoint
from megatron_gspo.models.config import preset

CFG = preset("tiny", num_hidden_layers=1, num_experts=2)


def _tensors(n: int, numel: int = 256) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.full((numel,), float(i))) for i in range(n)]  # 1 KiB each in fp32


def _write_sharded(path: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    path.mkdir(parents=True)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name)
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_reader_is_lazy_and_has_a_shape_view(tmp_path):
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.float64).to(torch.bfloat16)
    _write_sharded(tmp_path / "ck", [{"a": a}, {"b": b}])
    reads = []
    reader = HFCheckpointReader(tmp_path / "ck", on_read=lambda *read: reads.append(read))
    assert sorted(reader) == ["a", "b"] and len(reader) == 2 and "a" in reader and "c" not in reader
    shapes = reader.shapes
    assert shapes["a"].is_meta and tuple(shapes["a"].shape) == (3, 4) and shapes["b"].dtype == torch.bfloat16
    assert reads == [], "the shape view must not read data"
    assert torch.equal(reader["b"], b)
    assert reads == [("b", 10, "model-00002-of-00002.safetensors")]
    assert torch.equal(reader["a"], a) and torch.equal(reader["b"], b)
    assert len(reader._handles) == 1, "more than one shard open at a time"
    assert list(reader.file_bytes.values()) == [48, 10]
    with pytest.raises(KeyError):
        reader["c"]


def test_reader_single_file_and_bad_directories(tmp_path):
    (tmp_path / "single").mkdir()
    save_file({"x": torch.ones(2)}, tmp_path / "single" / "model.safetensors")
    assert torch.equal(HFCheckpointReader(tmp_path / "single")["x"], torch.ones(2))

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
        HFCheckpointReader(tmp_path / "empty")

    _write_sharded(tmp_path / "gone", [{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    (tmp_path / "gone" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        HFCheckpointReader(tmp_path / "gone")

    _write_sharded(tmp_path / "liar", [{"a": torch.ones(1), "b": torch.ones(1)}])
    index = tmp_path / "liar" / "model.safetensors.index.json"
    shard = "model-00001-of-00001.safetensors"
    index.write_text(json.dumps({"weight_map": {"a": shard, "c": shard}}))
    with pytest.raises(ValueError, match="disagree"):
        HFCheckpointReader(tmp_path / "liar")

    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        HFCheckpointReader(tmp_path / "corrupt")


def test_writer_streams_shards_of_bounded_size(tmp_path):
    out = tmp_path / "out"
    seen_on_disk = []

    def stream():
        for name, t in _tensors(7):
            # Shard files on disk when tensor i is requested: a full shard (3 tensors) is flushed as soon as the
            # next tensor does not fit, so the writer never holds more than one shard.
            seen_on_disk.append(len(list(tmp_path.glob(".out.tmp-*/shard-*.tmp"))))
            yield name, t

    write_hf_checkpoint(stream(), out, CFG, max_shard_bytes=3 * 1024)
    assert seen_on_disk == [0, 0, 0, 0, 1, 1, 1]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 7 * 1024
    assert index["weight_map"]["t3"] == "model-00002-of-00003.safetensors"
    reader = HFCheckpointReader(out)
    for name, t in _tensors(7):
        assert torch.equal(reader[name], t)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "float32"
    assert not list(tmp_path.glob(".out.*")), "temporary directory left behind"


def test_writer_single_shard_big_tensors_and_views(tmp_path):
    base = torch.arange(12.0)
    # a tensor larger than the shard limit gets a shard of its own; views of one storage are written as copies
    stream = [("big", torch.zeros(1024)), ("v0", base[:6]), ("v1", base[6:])]
    write_hf_checkpoint(stream, tmp_path / "a", CFG, max_shard_bytes=1024)
    reader = HFCheckpointReader(tmp_path / "a")
    assert len(reader.files) == 2 and torch.equal(reader["v1"], base[6:])
    write_hf_checkpoint(_tensors(2), tmp_path / "b", CFG)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["config.json", "integrity", "model.safetensors"]


def test_writer_failure_leaves_nothing_and_existing_output_is_protected(tmp_path):
    def broken():
        yield from _tensors(4)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        write_hf_checkpoint(broken(), tmp_path / "out", CFG, max_shard_bytes=1024)
    assert list(tmp_path.iterdir()) == []

    write_hf_checkpoint(_tensors(1), tmp_path / "out", CFG)
    with pytest.raises(FileExistsError):
        write_hf_checkpoint(_tensors(2), tmp_path / "out", CFG)
    with pytest.raises(ValueError, match="no tokenizer files"):
        write_hf_checkpoint(_tensors(2), tmp_path / "out2", CFG, tokenizer_dir=tmp_path)
    with pytest.raises(ValueError, match="appears twice"):
        write_hf_checkpoint(_tensors(2) + _tensors(1), tmp_path / "out3", CFG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    write_hf_checkpoint(_tensors(3), tmp_path / "out", CFG, overwrite=True)
    assert len(HFCheckpointReader(tmp_path / "out")) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("200KB") == 200_000
    assert parse_size("1GiB") == 2**30
    assert parse_size("123") == 123
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("lots")
