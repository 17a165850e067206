"""What a trainer checkpoint holds, apart from the bookkeeping CheckpointManager does (checkpoint.py):

  config.json, megatron_gspo.json, model/   the model, as a megatron dist_checkpointing checkpoint
                                            (checkpoint/model_io.py; loadable by any layout, convertible to HF)
  optimizer/rank_00000.pt                   megatron optimizer + LR schedule state of each rank
  rng/rank_00000.pt                         python / numpy / torch / megatron tracker RNG states of each rank
  run_config.yaml                           the resolved run config (what --resume compares against)

Optimizer and RNG state are per rank, so an exact resume needs the same layout; the model part reshards.
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


def write_trainer_contents(path: Path, rt, step: int, run_config_text: str) -> None:
    """Writes this rank's share of the step-`step` trainer checkpoint into the existing directory `path` (all
    ranks call)."""
    from megatron_gspo.checkpoint.model_io import write_model_checkpoint

    rank = dist.get_rank()
    write_model_checkpoint(rt.models, path, rt.model_config, metadata={"step": step})
    for sub in ("optimizer", "rng"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    save_durably(
        {"optimizer": rt.optimizer.state_dict(), "scheduler": rt.scheduler.state_dict()},
        path / "optimizer" / f"rank_{rank:05d}.pt",
    )
    save_durably(_rng_state(), path / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        with open(path / RUN_CONFIG, "w") as fh:
            fh.write(run_config_text)
            fh.flush()
            os.fsync(fh.fileno())


def load_trainer_contents(path: Path, rt) -> None:
    """Restores model, optimizer, schedule and RNG states from `path` (all ranks call)."""
    rank = dist.get_rank()
    opt = load_rank_file(path / "optimizer" / f"rank_{rank:05d}.pt")  # read (and checked) before anything changes
    rng = load_rank_file(path / "rng" / f"rank_{rank:05d}.pt")
    # Model first (master weights follow it), then the optimizer state, which restores the exact fp32 master
    # weights of a bf16 run (Float16OptimizerWithFloat16Params.load_state_dict copies its saved main params).
    rt.load_weights(path)
    try:
        rt.optimizer.load_state_dict(opt["optimizer"])
        rt.scheduler.load_state_dict(opt["scheduler"])
        _set_rng_state(rng)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"checkpoint {path}: optimizer / RNG state does not fit this run: {err}") from err


def rank_files(path: Path, world_size: int) -> list[Path]:
    """Files every complete checkpoint of `world_size` ranks has (beside trainer_state.json)."""
    per_rank = [path / sub / f"rank_{r:05d}.pt" for sub in ("optimizer", "rng") for r in range(world_size)]
    return [path / "model" / "metadata.json", path / "config.json", *per_rank]
