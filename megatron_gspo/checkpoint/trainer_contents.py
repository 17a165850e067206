"""What a trainer checkpoint holds, apart from the bookkeeping CheckpointManager does (manager.py):

  config.json, megatron_gspo.json, model/   the model, as a megatron dist_checkpointing checkpoint
                                            (checkpoint/model_io.py; loadable by any layout, convertible to HF)
  optimizer/                                optimizer state (fp32 masters, Adam moments) and LR schedule
                                            (checkpoint/optimizer_io.py): the distributed optimizer's as one
                                            shard file per rank, each written by its rank in parallel
                                            (checkpoint/optimizer_shards.py), the plain one's as a
                                            dist_checkpointing checkpoint; every element once; loadable by any
                                            layout
  rng/rank_00000.pt                         python / numpy / torch / megatron tracker RNG states of each rank
  run_config.yaml                           the resolved run config (what --resume compares against)

trainer_state.json (written by the manager) records FORMAT and the LAYOUT the checkpoint was written in. A resume
in another layout (TP, PP, EP, DP sizes...) reshards model and optimizer state; the per-rank RNG states then do
not belong to the new ranks and are left as the new run seeded them (`layout_changes` says what changed).
Format 1 (earlier versions: per-rank `optimizer/rank_*.pt` files of the unsharded optimizer) is not read.
Every file written here is fsynced by its writer; the manager syncs the directories and renames.
"""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

RUN_CONFIG = "run_config.yaml"


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save_durably(obj, path: Path) -> None:
    """torch.save through a Python file (so a full disk raises OSError ENOSPC, not torch's 'file write failed'),
    flushed and fsynced before returning."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def load_rank_file(path: Path):
    """torch.load of a per-rank file; a missing or damaged file is a ValueError naming it."""
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, weights_only=False)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as err:
        raise ValueError(f"checkpoint file {path} is unreadable or corrupt: {err}".splitlines()[0]) from err


FORMAT = 2
"""Trainer checkpoint format: 2 = optimizer state in dist_checkpointing (reshardable)."""


def check_resumable(path: Path, state: dict, *, distributed_optimizer: bool, ep: int) -> None:
    """Raises ValueError (one line, with the way out) when this version cannot resume the checkpoint at `path`
    (its trainer_state.json `state`) with the optimizer kind `distributed_optimizer` and expert-parallel size `ep`."""
    if state.get("format", 1) < FORMAT:
        raise ValueError(
            f"{path} was written by an older megatron-gspo (per-rank optimizer files, checkpoint format "
            f"{state.get('format', 1)}), which this version does not resume: start a new run with "
            f"model.load={path} (weights only)"
        )
    layout = state.get("layout") or {}
    if layout.get("distributed_optimizer") is False and not distributed_optimizer and layout.get("ep", 1) != ep:
        # The plain optimizer's state is keyed by sub-optimizer, and megatron splits off an expert optimizer
        # for EP > 1 only: it reshards over TP / PP / DP (tests/training/test_resume_layout.py), not over EP.
        raise ValueError(
            f"{path} holds the plain optimizer's state (optim.distributed=false), which does not resume with "
            f"another expert-parallel size (ep {layout.get('ep', 1)} -> {ep}): resume with "
            f"parallel.ep={layout.get('ep', 1)}"
        )


def current_layout(rt) -> dict:
    """What a checkpoint's per-rank and sharded state depends on: parallel sizes, data-parallel size, world size,
    and whether the optimizer is the distributed one."""
    from megatron_gspo.checkpoint.model_io import _layout

    layout = _layout(rt.models)
    layout.update(dp=rt.dp.size, distributed_optimizer=bool(rt.cfg.optim.distributed))
    return layout


def layout_changes(saved: dict, current: dict) -> list[str]:
    """'key saved -> current' for every layout entry that differs (entries the checkpoint lacks are not compared)."""
    return [f"{k} {saved[k]} -> {current.get(k)}" for k in sorted(saved) if saved[k] != current.get(k)]


def write_trainer_contents(path: Path, rt, step: int, run_config_text: str, *, asynchronous: bool = False) -> list:
    """Writes this rank's share of the step-`step` trainer checkpoint into the existing directory `path` (all
    ranks call). `asynchronous`: the model and optimizer tensors are left to the AsyncRequests returned (the
    CheckpointManager starts them); otherwise everything is written and the list is empty."""
    from megatron_gspo.checkpoint.model_io import write_model_checkpoint
    from megatron_gspo.checkpoint.optimizer_io import write_optimizer_checkpoint

    rank = dist.get_rank()
    rt.params_ready()
    requests = [
        write_model_checkpoint(rt.models, path, rt.model_config, metadata={"step": step}, asynchronous=asynchronous),
        write_optimizer_checkpoint(rt.chunks, rt.optimizer, rt.scheduler, path, asynchronous=asynchronous),
    ]
    (path / "rng").mkdir(parents=True, exist_ok=True)
    save_durably(_rng_state(), path / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        with open(path / RUN_CONFIG, "w") as fh:
            fh.write(run_config_text)
            fh.flush()
            os.fsync(fh.fileno())
    return [r for r in requests if r is not None]


def load_trainer_contents(path: Path, rt, *, same_layout: bool = True) -> None:
    """Restores model, optimizer and schedule states from `path` into this run's layout, and each rank's RNG
    states when `same_layout` (all ranks call)."""
    from megatron_gspo.checkpoint.optimizer_io import load_optimizer_checkpoint

    rank = dist.get_rank()
    rng = load_rank_file(path / "rng" / f"rank_{rank:05d}.pt") if same_layout else None  # checked first
    # Model first, then the optimizer state, which restores the exact fp32 master weights (megatron's optimizers
    # copy the loaded masters into their main params).
    rt.load_weights(path, verify=False)  # the trainer checked the whole checkpoint (integrity.verify)
    load_optimizer_checkpoint(rt.chunks, rt.optimizer, rt.scheduler, path)
    if rng is not None:
        try:
            _set_rng_state(rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"checkpoint {path}: RNG state does not fit this run: {err}") from err


def rank_files(path: Path, world_size: int) -> list[Path]:
    """Files every complete checkpoint of `world_size` ranks has (beside trainer_state.json; the optimizer's
    depend on its kind: checkpoint/optimizer_io.py)."""
    per_rank = [path / "rng" / f"rank_{r:05d}.pt" for r in range(world_size)]
    return [path / "model" / "metadata.json", path / "config.json", *per_rank]
