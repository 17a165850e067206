"""Integrity records (checkpoint/integrity.py): bytes changed inside a checkpoint file, a file cut short or gone
are named in one line; a Hugging Face directory `convert` writes carries the record and its reader checks it; a
truncated safetensors file is named by `convert` in one line. (Trainer checkpoints: tests/training/test_run_dir.py
and test_async_checkpoint.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.checkpoint import integrity
from megatron_gspo.checkpoint.hf_io import HFCheckpointReader, write_hf_checkpoint
from megatron_gspo.models.config import preset
from tests.checkpoint.test_bad_input import _hf_dir

ROOT = Path(__file__).resolve().parents[2]
CFG = preset("tiny", num_hidden_layers=1, num_experts=2)


def overwrite_middle(path: Path, byte: int, n: int = 4096) -> None:
    """Writes n copies of `byte` into the middle of `path` (size unchanged), as a bad disk or a stray dd would."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - n // 2)
    data[start : start + n] = bytes([byte]) * len(data[start : start + n])
    path.write_bytes(bytes(data))


def overwrite_tensor_bytes(shard: Path, byte: int, n: int = 4096) -> None:
    """Writes n copies of `byte` into the middle of the largest tensor's bytes in the DCP file or torch.save file
    (`.pt`) `shard` (its size unchanged): the tensor data, not the serialization around it, which torch would find
    damaged by itself."""
    from torch.distributed.checkpoint import FileSystemReader

    if shard.suffix == ".pt":
        _overwrite_zip_tensor_bytes(shard, byte, n)
        return
    items = [i for i in FileSystemReader(str(shard.parent)).read_metadata().storage_data.values()
             if i.relative_path == shard.name]
    largest = max(items, key=lambda i: i.length)
    assert largest.length > 4 * n, largest
    data = bytearray(shard.read_bytes())
    start = largest.offset + largest.length // 2
    data[start : start + n] = bytes([byte]) * n
    shard.write_bytes(bytes(data))


def _overwrite_zip_tensor_bytes(path: Path, byte: int, n: int) -> None:
    """The same for a torch.save file: a zip archive whose tensor storages are stored uncompressed (`data/<k>`)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        largest = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert largest.file_size > 4 * n and largest.compress_type == zipfile.ZIP_STORED, largest
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[largest.header_offset + 26 : largest.header_offset + 30])
    start = largest.header_offset + 30 + name_len + extra_len + largest.file_size // 2
    data[start : start + n] = bytes([byte]) * n
    path.write_bytes(bytes(data))


def _two_rank_checkpoint(root: Path) -> Path:
    """A directory laid out like a trainer checkpoint of two ranks, recorded as the trainer records it."""
    for rank in (0, 1):
        (root / "model").mkdir(parents=True, exist_ok=True)
        (root / "model" / f"__{rank}_0.distcp").write_bytes(bytes(range(256)) * 64 * (rank + 1))
        (root / "rng").mkdir(exist_ok=True)
        (root / "rng" / f"rank_{rank:05d}.pt").write_bytes(b"rng" * 100)
    (root / "model" / ".metadata").write_bytes(b"meta" * 50)
    (root / "config.json").write_text("{}")
    for rank in (0, 1):
        integrity.record_rank_files(root, rank)
    integrity.record_common_files(root, 2)
    (root / "trainer_state.json").write_text('{"step": 1}')  # written after the record, never in it
    return root


def test_record_lists_each_file_once_by_the_rank_that_wrote_it(tmp_path):
    root = _two_rank_checkpoint(tmp_path / "ck")
    r0 = json.loads((root / "integrity" / "rank_00000.json").read_text())["files"]
    r1 = json.loads((root / "integrity" / "rank_00001.json").read_text())["files"]
    common = json.loads((root / "integrity" / "common.json").read_text())["files"]
    assert set(r0) == {"model/__0_0.distcp", "rng/rank_00000.pt"}
    assert set(r1) == {"model/__1_0.distcp", "rng/rank_00001.pt"}
    assert set(common) == {"model/.metadata", "config.json"}
    assert r1["model/__1_0.distcp"]["size"] == 2 * 256 * 64
    assert integrity.verify(root) is True


@pytest.mark.parametrize("byte", [0x00, 0xFF])
def test_changed_bytes_are_named(tmp_path, byte):
    root = _two_rank_checkpoint(tmp_path / "ck")
    overwrite_middle(root / "model" / "__1_0.distcp", byte)
    with pytest.raises(integrity.CheckpointDamaged) as info:
        integrity.verify(root)
    line = str(info.value)
    assert "\n" not in line
    assert f"checkpoint file {root / 'model' / '__1_0.distcp'} is damaged: its bytes changed" in line
    assert integrity.verify(root, ("rng/",)) is True  # a load that reads other files is not refused


def test_cut_short_missing_and_unrecorded_ranks_are_named(tmp_path):
    root = _two_rank_checkpoint(tmp_path / "ck")
    shard = root / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        integrity.CheckpointDamaged, match=r"__0_0.distcp is damaged: 100 bytes, 16384 were written"
    ):
        integrity.verify(root)
    shard.unlink()
    with pytest.raises(integrity.CheckpointDamaged, match=r"__0_0.distcp is damaged: the file is missing"):
        integrity.verify(root)
    (root / "integrity" / "rank_00001.json").unlink()
    with pytest.raises(integrity.CheckpointDamaged, match="its integrity record is unreadable"):
        integrity.verify(root)
    with pytest.raises(RuntimeError, match="rank 1 wrote no integrity record"):
        integrity.record_common_files(root, 2)  # what completing such a checkpoint says
    (root / "integrity" / "rank_00001.json").write_text(
        json.dumps({"algorithm": "crc32", "error": "OSError: EIO"})
    )
    with pytest.raises(RuntimeError, match="rank 1 could not hash its checkpoint files: OSError: EIO"):
        integrity.record_common_files(root, 2)


def test_a_checkpoint_without_a_record_is_read_unchecked(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "x.distcp").write_bytes(b"1234")
    assert integrity.verify(tmp_path / "old") is False


@pytest.mark.parametrize("byte", [0x00, 0xFF])
def test_hf_export_carries_a_record_that_its_reader_checks(tmp_path, byte):
    tensors = [(f"t{i}", torch.full((4096,), float(i))) for i in range(3)]
    out = write_hf_checkpoint(tensors, tmp_path / "hf", CFG, max_shard_bytes=20000)
    record = json.loads((out / "integrity" / "common.json").read_text())["files"]
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00003.safetensors"} <= set(record)
    assert torch.equal(HFCheckpointReader(out)["t2"], tensors[2][1])
    overwrite_middle(out / "model-00002-of-00003.safetensors", byte)
    with pytest.raises(integrity.CheckpointDamaged, match="model-00002-of-00003.safetensors is damaged"):
        HFCheckpointReader(out)


def test_convert_names_a_truncated_safetensors_file_in_one_line(tmp_path):
    hf = _hf_dir(tmp_path / "hf")
    shard = hf / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])  # cut in its data, after an intact header
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_gspo.cli.main",
            "convert",
            "hf-to-megatron",
            "--hf",
            str(hf),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    (line,) = [x for x in res.stderr.strip().splitlines() if "error" in x]
    assert f"{shard} is not a readable safetensors file" in line and "truncated" in line, line
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_passed_over_is_set_aside_so_pruning_keeps_the_next_save(tmp_path):
    # Left in place, a damaged newer checkpoint counts as the run's newest: with keep_last=1 the first save after
    # the fallback was pruned and the damaged one kept, losing everything at the next --resume.
    from megatron_gspo.checkpoint.manager import CheckpointManager

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        ck = _two_rank_checkpoint(root / f"iter_{step:07d}")
        (ck / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": "r"}))
    (root / "latest").write_text("iter_0000002")
    overwrite_middle(root / "iter_0000002" / "model" / "__1_0.distcp", 0x00)
    manager = CheckpointManager(root, keep_last=1, run_id="r")
    point = manager.intact(manager.find_latest(), lambda path, state: (path, state))
    assert point[0].name == "iter_0000001"
    assert [p.name for p, _ in manager.checkpoints()] == ["iter_0000001"]
    assert (root / "iter_0000002.damaged" / "model" / "__1_0.distcp").is_file()
    # The resumed run's next checkpoint (step 2 again) is then the newest and survives pruning.
    ck = _two_rank_checkpoint(root / "iter_0000002")
    (ck / "trainer_state.json").write_text(json.dumps({"step": 2, "run_id": "r"}))
    manager._prune()
    assert [p.name for p, _ in manager.checkpoints()] == ["iter_0000002"]


def test_an_hf_directory_with_an_edited_config_still_reads_but_not_with_changed_weights(tmp_path):
    # Users edit config.json (rope scaling, token ids) in an exported directory: only the weights are checked.
    from megatron_gspo.checkpoint.hf_io import HFCheckpointReader

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (hf / "config.json").write_text("{}")
    integrity.record_all_files(hf)
    (hf / "config.json").write_text('{"rope_scaling": null}')
    assert integrity.verify(hf, ("model",), collective=False) is True
    overwrite_middle(hf / "model.safetensors", 0xFF)
    with pytest.raises(integrity.CheckpointDamaged, match="model.safetensors is damaged"):
        HFCheckpointReader(hf)
