"""The distributed optimizer's state as per-rank shard files that any layout loads (trainer checkpoint format 2,
`optimizer/` of a run with optim.distributed=true):

    optimizer/distributed.pt      rank 0: param groups (hyperparameters, Adam's step), grad scaler, LR schedule,
                                  the world size that wrote the shards
    optimizer/rank_<r:05d>.pt     rank r: the fp32 master and Adam moments of its own distributed-optimizer shard

Why our own format. megatron-core 0.16.1's DistributedOptimizer offers three (distrib_optimizer.py):
`fully_reshardable` (`sharded_param_state_fully_reshardable`, ~1404) gathers each data-parallel group's state onto
one rank -- with `mem_efficient` over gloo into DP rank 0's host memory (`get_parameter_state_dp_zero`, ~977),
otherwise with NCCL onto every rank -- so one rank's memory and writes scale with its whole model-parallel shard;
`dp_reshardable` (~1539) writes each rank's bucket shards without communication but keys them by the DP group's
bucket layout (`dp_group_idx_*`, ~1247-1262), so only the same TP / PP / EP and bucketing restores it;
`fully_sharded_model_space` (~1689) is bounded and reshards, but describes shards with `flattened_range`, which
megatron's own torch_dist strategy refuses (dist_checkpointing/strategies/torch.py ~297-302) and which is marked
for deprecation. None is both bounded and reshardable with the torch_dist backend, hence this format.

Saving (no communication): for every model parameter its shard touches (`_get_model_param_range_map(p)["param"]`,
the shard's flat range inside the rank-local parameter), each rank writes the slice it owns of the fp32 master,
exp_avg and exp_avg_sq (`_get_main_param_and_optimizer_states`), described by the parameter's global identity as
megatron's model `sharded_state_dict` gives it: key, global shape, this rank's global offset (TP / EP / PP), and
the flat range within the local tensor. A local tensor that megatron stores as several global tensors
(`ShardedTensorFactory`, e.g. SwiGLU's fc1 halves under TP) is split into its pieces by where they sit in the
parameter's storage. Elements replicated over TP (replica id with a nonzero non-DP part) are written by the main
replica only. Host memory and bytes written: the rank's own shard, once (a host copy, then the file).

Loading (no communication): each rank rebuilds its shard, one local parameter piece at a time: every saved chunk
of the same key whose global box meets the piece's is unflattened into its old local tensor and the overlap is
copied into the new local tensor, then the new flat range is taken -- so TP splits on any dimension (a flat range
of a row-parallel weight is not contiguous globally) and any DP / PP / EP change work. The files are memory-mapped
and every box is narrowed to the whole rows its flat range covers (`_narrow`): beyond the optimizer, a load holds
one parameter's shard (a copy per state, for megatron's setter) and one saved chunk at a time, each widened by at
most two rows, plus the page cache.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.checkpoint.model_io import spec_alias
from megatron_gspo.errors import RankFailed, describe

COMMON_FILE = "distributed.pt"
KEYS = ("param", "exp_avg", "exp_avg_sq")
VERSION = 1


def rank_file(root: Path, rank: int) -> Path:
    """The shard file of `rank` (named like the other per-rank files, so integrity.owned_by_rank records it)."""
    return root / f"rank_{rank:05d}.pt"


def _subs(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _sharded_tensors(model_sharded: dict) -> list:
    """Every ShardedTensor of a model sharded state dict, factories built into their pieces."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: list = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, ShardedTensorFactory):
            walk(node.build())
        elif isinstance(node, ShardedTensor) and node.data is not None:
            out.append(node)

    walk(model_sharded)
    return out


def _pieces_by_place(model_sharded: dict) -> dict[tuple[int, int], list]:
    """{(storage address, element offset in it): the ShardedTensors whose data starts there}. The distributed
    optimizer's params live in DDP's contiguous buffers, so a parameter is found by where it sits in one."""
    by_place: dict[tuple[int, int], list] = {}
    for st in _sharded_tensors(model_sharded):
        if st.data.is_contiguous():
            by_place.setdefault((st.data.untyped_storage().data_ptr(), st.data.storage_offset()), []).append(st)
    return by_place


def _param_pieces(p: torch.Tensor, by_place: dict) -> list[tuple[int, object]]:
    """[(flat offset in p, ShardedTensor)] tiling p: the global tensors its local values belong to (one, or the
    pieces of a factory, e.g. SwiGLU's fc1 halves), found by their place in p's storage. Of several at one place,
    the first key wins (a parameter stored under two keys holds the same values under both)."""
    ptr, base = p.untyped_storage().data_ptr(), p.storage_offset()
    found: list[tuple[int, object]] = []
    covered = 0
    while covered < p.numel():
        fitting = [st for st in by_place.get((ptr, base + covered), []) if covered + st.data.numel() <= p.numel()]
        if not fitting:
            raise ValueError(f"cannot place a parameter of shape {tuple(p.shape)} in the model's sharded state dict "
                             f"(nothing at element {covered})")
        st = min(fitting, key=lambda t: (-t.data.numel(), t.key))
        found.append((covered, st))
        covered += st.data.numel()
    return found


def _local_shape(st) -> tuple[int, ...]:
    """The local tensor's shape in the global tensor's dimensions (prepended axes, e.g. a layer index: size 1)."""
    return (1,) * st.prepend_axis_num + tuple(st.data.shape)


def _is_main_replica(st) -> bool:
    """Whether this rank's copy is the one to write: megatron's replica id is (0, TP rank where the tensor is
    replicated over TP, DP rank); the distributed optimizer splits DP replicas into disjoint shards already."""
    rid = st.replica_id
    return not any(rid[:-1]) if isinstance(rid, tuple) else True


def _owned(optimizer, model_sharded: dict, *, for_saving: bool):
    """Yields (sub-optimizer, model param, ShardedTensor of the piece, start and end of the shard's range within
    the piece's flat local tensor, where that range starts in the param's shard) for every piece of every
    parameter this rank's shard touches (megatron's `param_map` ranges, distrib_optimizer.py
    `_build_model_gbuf_param_range_map`); saving skips the pieces another rank writes."""
    by_place = _pieces_by_place(model_sharded)
    for sub in _subs(optimizer):
        for gbuf_range_maps in sub.gbuf_ranges:
            for per_bucket in gbuf_range_maps.values():
                for gbuf_range_map in per_bucket:
                    for p, ranges in gbuf_range_map["param_map"].items():
                        r = ranges["param"]
                        for off, st in _param_pieces(p, by_place):
                            a, b = max(r.start, off), min(r.end, off + st.data.numel())
                            if a >= b or (for_saving and not _is_main_replica(st)):
                                continue
                            yield sub, p, st, a - off, b - off, a - r.start


def shard_chunks(optimizer, model_sharded: dict) -> list[dict]:
    """This rank's chunks: host copies of its own slices of the masters and moments with their global places."""
    chunks = []
    for sub, p, st, a, b, at in _owned(optimizer, model_sharded, for_saving=True):
        tensors = sub._get_main_param_and_optimizer_states(p)
        chunk = {"key": st.key, "global_shape": tuple(st.global_shape), "global_offset": tuple(st.global_offset),
                 "local_shape": _local_shape(st), "start": a, "end": b}
        for k in KEYS:
            # A copy, not a view: torch.save writes a view's whole storage.
            chunk[k] = tensors[k].detach().view(-1)[at : at + b - a].to("cpu", torch.float32, copy=True)
        chunks.append(chunk)
    return chunks


def _save_file(obj, path: Path) -> None:
    """torch.save through `path.tmp`, fsynced, renamed (the caller syncs the directory with the tree)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_shards(optimizer, model_sharded: dict, root: Path, common: dict) -> None:
    """Writes this rank's `rank_<r>.pt` (every rank, in parallel; no communication but the final agreement) and,
    on rank 0, `common` into `distributed.pt`; `root` exists. Returns on every rank once all files are written;
    a failure on any rank raises on every rank (so that none goes on to read or to its next collective alone)."""
    rank = dist.get_rank()
    error = None
    try:
        _save_file({"version": VERSION, "chunks": shard_chunks(optimizer, model_sharded)}, rank_file(root, rank))
        if rank == 0:
            _save_file({**common, "version": VERSION, "world_size": dist.get_world_size()}, root / COMMON_FILE)
    except Exception as err:  # noqa: BLE001 - raised below, on every rank
        error = err
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if error is None else describe(error))
    if error is not None:
        raise error
    failed = [(r, line) for r, line in enumerate(everyone) if line is not None]
    if failed:
        raise RankFailed(f"writing {root}", *failed[0])


def load_file(path: Path, *, mmap: bool = False):
    """torch.load of a file of this format; missing or damaged: a ValueError naming it."""
    if not path.is_file():
        raise ValueError(f"optimizer checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        raise ValueError(f"optimizer checkpoint file {path} is unreadable or corrupt: {err}".splitlines()[0]) from err


def _saved_chunks(root: Path, world_size: int) -> dict[str, list[dict]]:
    """{key: chunks} of every rank file, memory-mapped (their tensors are read when used)."""
    by_key: dict[str, list[dict]] = {}
    for r in range(world_size):
        path = rank_file(root, r)
        data = load_file(path, mmap=True)
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("chunks"), list):
            raise ValueError(f"optimizer checkpoint file {path} is not a version-{VERSION} shard file")
        for chunk in data["chunks"]:
            by_key.setdefault(chunk["key"], []).append(chunk)
    return by_key


def _box_overlap(off_a, shape_a, off_b, shape_b):
    """The overlap of two boxes as per-dimension (start, stop) in global coordinates, or None."""
    lo = [max(x, y) for x, y in zip(off_a, off_b)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(off_a, shape_a, off_b, shape_b)]
    return None if any(a >= b for a, b in zip(lo, hi)) else list(zip(lo, hi))


def _narrow(offset, shape, start: int, end: int):
    """The box of whole rows (along the first dimension larger than 1) that holds the flat range [start, end) of a
    local tensor at global `offset` with `shape`, and the range within it: (offset, shape, start, end). Keeps
    what a chunk is unflattened into to its own size plus two rows, rather than the whole local tensor."""
    offset, shape = list(offset), list(shape)
    dim = next((d for d, n in enumerate(shape) if n > 1), None)
    if dim is None:
        return offset, shape, start, end
    row = int(torch.Size(shape[dim + 1 :]).numel())
    first, last = start // row, -(-end // row)
    offset[dim] += first
    shape[dim] = last - first
    return offset, shape, start - first * row, end - first * row


def _piece_values(st, a: int, b: int, chunks: list[dict], root: Path) -> dict[str, torch.Tensor]:
    """{state key: flat fp32 values of the new piece's range [a, b)} assembled from the saved chunks of its key:
    each overlapping chunk is unflattened into its (narrowed) old local box, and the boxes' overlap is copied."""
    offset, shape, a, b = _narrow(st.global_offset, _local_shape(st), a, b)
    numel = int(torch.Size(shape).numel())
    out = {k: torch.empty(numel, dtype=torch.float32) for k in KEYS}
    filled = torch.zeros(numel, dtype=torch.bool)
    for chunk in chunks:
        if tuple(chunk["global_shape"]) != tuple(st.global_shape):
            raise ValueError(f"optimizer checkpoint {root}: {st.key} has global shape {tuple(chunk['global_shape'])} "
                             f"there and {tuple(st.global_shape)} in this model")
        old_offset, old_shape, start, end = _narrow(chunk["global_offset"], chunk["local_shape"], chunk["start"],
                                                    chunk["end"])
        box = _box_overlap(old_offset, old_shape, offset, shape)
        if box is None:
            continue
        old_numel = int(torch.Size(old_shape).numel())
        src_sel = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, old_offset))
        dst_sel = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, offset))
        have = torch.zeros(old_numel, dtype=torch.bool)
        have[start:end] = True
        mask = have.view(old_shape)[src_sel]
        if not bool(mask.any()):
            continue
        for k in KEYS:
            old = torch.zeros(old_numel, dtype=torch.float32)
            old[start:end] = chunk[k]
            dst = out[k].view(shape)[dst_sel]
            dst[mask] = old.view(old_shape)[src_sel][mask]
        filled.view(shape)[dst_sel] |= mask
    if not bool(filled[a:b].all()):
        raise ValueError(f"optimizer checkpoint {root} lacks part of {st.key}'s optimizer state "
                         f"(global offset {tuple(st.global_offset)}, local shape {_local_shape(st)}): written by "
                         "another model or incomplete")
    return {k: v[a:b] for k, v in out.items()}


def read_common(root: Path) -> dict:
    data = load_file(root / COMMON_FILE)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"optimizer checkpoint file {root / COMMON_FILE} is not a version-{VERSION} common file")
    return data


@torch.no_grad()  # fp32 params' masters are views of the model params (leaves that require grad)
def load_shards(optimizer, model_sharded: dict, root: Path, world_size: int) -> None:
    """Copies the saved masters and moments of this rank's shard into its optimizer (every rank; no communication;
    after the param groups are loaded, which allocates the optimizer state)."""
    saved = _saved_chunks(root, world_size)
    for sub, p, st, a, b, at in _owned(optimizer, model_sharded, for_saving=False):
        # A checkpoint of the other layer spec (local on CPU, TE on GPU) names a few tensors differently.
        key = st.key if st.key in saved else spec_alias(st.key)
        if key not in saved:
            raise ValueError(f"optimizer checkpoint {root} has no optimizer state for {st.key}")
        values = _piece_values(st, a, b, saved[key], root)
        current = sub._get_main_param_and_optimizer_states(p)
        # Through megatron's setter (a precision-aware optimizer scales on set), which sets whole shards: this
        # parameter's shard with the piece's range replaced; the other entries (torch Adam's step) as they are.
        update = {}
        for k in KEYS:
            update[k] = current[k].detach().clone()
            update[k].view(-1)[at : at + b - a] = values[k].to(update[k].device, update[k].dtype)
        sub._set_main_param_and_optimizer_states(p, {**current, **update})
