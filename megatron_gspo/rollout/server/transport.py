"""The file transports of weight sync: each version written as a Hugging Face safetensors directory.

`write_checkpoint_dir` turns buckets into shards + `model.safetensors.index.json` in a hidden sibling directory that
is renamed into place (atomic: the final path only ever appears complete). Where it lives picks the medium:
- disk: a directory every server can read (a shared file system for servers on other hosts);
- shared memory: a directory under /dev/shm (tmpfs, RAM only), for servers on the trainer's host.
`read_checkpoint_dir` is the server side (it runs inside the server's environment: torch + safetensors only).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatron_gspo.rollout.server.buckets import NamedTensor, tensor_nbytes

INDEX_FILE = "model.safetensors.index.json"
SHM_ROOT = Path("/dev/shm")
"""Linux's RAM-backed file system: what the `shm` transport writes under."""

TRANSPORTS = ("shm", "disk")


def transport_root(transport: str, directory: str | None, run_id: str) -> Path:
    """Where versions are written: `directory` for disk; /dev/shm/megatron_gspo-<pid>-<run_id> for shm, after
    removing the shm roots of this user's processes that are gone (`remove_orphan_roots`)."""
    if transport == "shm":
        if not SHM_ROOT.is_dir():
            raise RuntimeError(f"weight transport 'shm' needs {SHM_ROOT} (Linux tmpfs); use 'disk' here")
        remove_orphan_roots()
        return SHM_ROOT / f"megatron_gspo-{os.getpid()}-{run_id}"
    if transport == "disk":
        if not directory:
            raise ValueError("the disk weight transport needs a directory readable by the servers")
        return Path(directory)
    raise ValueError(f"weight transport {transport!r} must be one of {TRANSPORTS}")


def write_checkpoint_dir(buckets: Iterable[list[NamedTensor]], target: Path) -> list[str]:
    """Writes the buckets as safetensors shards + index into `target`, atomically; returns the names written.

    Everything goes to a hidden sibling directory first (fsynced), which is renamed to `target` at the end; on
    any error the temporary directory is removed and `target` is untouched. An existing `target` is replaced.
    """
    from safetensors.torch import save_file

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    names: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for i, bucket in enumerate(buckets):
            shard = f"model-{i + 1:05d}.safetensors"
            # copy=True: safetensors refuses tensors that share storage (views of one fused parameter).
            tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in bucket}
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
            _fsync_file(tmp / shard)
            for name, t in tensors.items():
                weight_map[name] = shard
                names.append(name)
                total += tensor_nbytes(t)
        if not names:
            raise ValueError("weight exporter yielded no tensors")
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))
        _fsync_file(tmp / INDEX_FILE)
        _fsync_dir(tmp)
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint_dir(path: str | Path) -> Iterator[NamedTensor]:
    """(name, tensor) pairs of a directory written by `write_checkpoint_dir`, one shard open at a time.

    Raises a one-line error naming the directory when the index and the shards disagree.
    """
    from safetensors import safe_open

    path = Path(path)
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} does not exist (not a weight-sync directory)")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    for shard in sorted(shards):
        with safe_open(str(path / shard), framework="pt") as f:
            present = set(f.keys())
            missing = [n for n in shards[shard] if n not in present]
            if missing:
                raise ValueError(f"{path / shard} lacks {missing[0]} listed in {INDEX_FILE}")
            for name in shards[shard]:
                yield name, f.get_tensor(name)


def remove_orphan_roots(shm: Path = SHM_ROOT) -> list[Path]:
    """Removes the shm roots (`megatron_gspo-<pid>-...`) of this user whose process no longer runs; returns them.

    A trainer that ends normally removes its root (RAM: a whole model per version); one killed (kill -9, the OOM
    killer, a preempted job on a reused node) cannot, and its versions would hold that RAM until a reboot: the
    next run on the host, typically its resume, frees them. A pid reused by another process keeps its root."""
    removed = []
    for root in shm.glob("megatron_gspo-*"):
        parts = root.name.split("-")
        try:
            if len(parts) != 3 or not parts[1].isdigit() or root.stat().st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            remove_dir(root)
            removed.append(root)
        except OSError:  # gone meanwhile, or a live process of another user (PermissionError)
            continue
    return removed


def remove_dir(path: Path | None) -> None:
    """Removes a version directory (best effort: a server may still hold it open)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
