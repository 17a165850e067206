"""Weight buckets and the file transports (content, atomicity, the reader the servers use)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.server.buckets import iter_buckets, tensor_nbytes, with_last
from megatron_gspo.rollout.server.transport import (
    INDEX_FILE,
    SHM_ROOT,
    read_checkpoint_dir,
    transport_root,
    write_checkpoint_dir,
)

MB = 1024 * 1024


def named_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g).bfloat16()),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g).bfloat16()),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", torch.randn(4, 8, generator=g)),
        ("model.layers.0.mlp.gate.weight", torch.randn(2, 8, generator=g)),
        ("model.norm.weight", torch.ones(8)),
        ("lm_head.weight", torch.randn(16, 8, generator=g).bfloat16()),
    ]


def test_buckets_respect_the_size_and_keep_order():
    sizes = [10, 20, 5, 40, 1, 1, 30]
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]
    buckets = list(iter_buckets(tensors, bucket_bytes=30 * 4))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    for b in buckets:  # a bucket only exceeds the limit when it holds one oversized tensor
        assert sum(tensor_nbytes(t) for _, t in b) <= 30 * 4 or len(b) == 1
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    assert list(iter_buckets([], 10)) == []
    as_dict = dict(tensors)  # a dict exporter (export_hf_state_dict) works the same way
    assert [[n for n, _ in b] for b in iter_buckets(as_dict, 30 * 4)] == [[n for n, _ in b] for b in buckets]


def test_buckets_reject_exporter_bugs():
    with pytest.raises(ValueError, match="yielded 'a' twice"):
        list(iter_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))], 100))
    with pytest.raises(TypeError, match="expected \\(str, Tensor\\)"):
        list(iter_buckets([("a", [1.0])], 100))


def test_with_last():
    assert list(with_last("abc")) == [("a", False), ("b", False), ("c", True)]
    assert list(with_last([])) == []


def test_checkpoint_dir_is_written_atomically(tmp_path):
    target = tmp_path / "weights-v1"
    weights = named_weights()

    def exporter():
        for name, tensor in weights:
            # while tensors are still being written, the final path must not exist
            assert not target.exists()
            yield name, tensor

    write_checkpoint_dir(iter_buckets(exporter(), bucket_bytes=300), target)
    index = json.loads((target / INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(n for n, _ in weights)
    assert len(set(index["weight_map"].values())) > 1  # several shards
    assert [p.name for p in tmp_path.iterdir()] == ["weights-v1"]  # no temporary left behind

    def failing():
        yield weights[0]
        raise RuntimeError("exporter crashed")

    broken = tmp_path / "weights-v2"
    with pytest.raises(RuntimeError, match="exporter crashed"):
        write_checkpoint_dir(iter_buckets(failing(), 300), broken)
    assert [p.name for p in tmp_path.iterdir()] == ["weights-v1"]


def test_reader_returns_what_the_writer_wrote(tmp_path):
    weights = dict(named_weights())
    write_checkpoint_dir(iter_buckets(weights, bucket_bytes=300), tmp_path / "v")
    back = list(read_checkpoint_dir(tmp_path / "v"))
    assert sorted(n for n, _ in back) == sorted(weights)
    for name, tensor in back:
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name])
    with pytest.raises(FileNotFoundError, match="not a weight-sync directory"):
        list(read_checkpoint_dir(tmp_path))


WRITER = """
import sys, time
from megatron_gspo.rollout.server.transport import transport_root
root = transport_root("shm", None, "killed")
(root / "weights-v3").mkdir(parents=True)
(root / "weights-v3" / "model-00001.safetensors").write_bytes(bytes(1 << 20))
print(root, flush=True)
time.sleep(600)
"""


# Linux always has /dev/shm (CI: never skipped); elsewhere the transport writes under the temporary directory.
@pytest.mark.skipif(not SHM_ROOT.is_dir() and not os.environ.get("CI"), reason="no /dev/shm (not Linux)")
def test_the_shm_root_of_a_killed_trainer_is_removed_by_the_next_one():
    """A trainer SIGKILLed with versions in /dev/shm (RAM) cannot remove them; the next shm root made on the host
    (the resumed run's) removes the roots of this user's processes that are gone, and keeps a live one's."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        killed = proc.stdout.readline().strip()
        assert killed.startswith(f"{SHM_ROOT}/megatron_gspo-{proc.pid}-"), killed
        alive = transport_root("shm", None, "alive")  # the writer still runs: its root stays
        alive.mkdir()
        assert os.path.isdir(killed)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        mine = transport_root("shm", None, "resumed")
        assert not os.path.exists(killed)
        assert alive.is_dir() and mine.parent == SHM_ROOT and mine.name.startswith(f"megatron_gspo-{os.getpid()}-")
    finally:
        alive.rmdir()
