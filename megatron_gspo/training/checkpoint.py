"""Trainer checkpoints: written to a temporary directory, renamed when complete, `latest` updated last.

Layout of `checkpoints/iter_0000012/`:
  config.json, megatron_gspo.json, model/   the model, as a megatron dist_checkpointing checkpoint
                                            (checkpoint/model_io.py; loadable by any layout, convertible to HF)
  optimizer/rank_00000.pt                   megatron optimizer + LR schedule state of each rank
  rng/rank_00000.pt                         python / numpy / torch / megatron tracker RNG states of each rank
  trainer_state.json                        step, data position, summary so far
Optimizer and RNG state are per rank, so an exact resume needs the same layout; the model part reshards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

_ITER = "iter_{:07d}"


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


class CheckpointManager:
    """Saves / finds / loads trainer checkpoints under `root`, keeping the last `keep_last`."""

    def __init__(self, root: Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint (`latest` is only written after the rename)."""
        marker = self.root / "latest"
        if not marker.is_file():
            return None
        path = self.root / marker.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise RuntimeError(f"{marker} points to {path}, which is not a complete checkpoint")
        return path

    def save(self, step: int, rt, trainer_state: dict) -> Path:
        """All ranks call. Returns the final path."""
        from megatron_gspo.checkpoint.model_io import save_model_checkpoint

        rank = dist.get_rank()
        final = self.root / _ITER.format(step)
        tmp = self.root / (_ITER.format(step) + ".tmp")
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            self.root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_model_checkpoint(rt.models, tmp, rt.model_config, metadata={"step": step})
        for sub in ("optimizer", "rng"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
        torch.save(
            {"optimizer": rt.optimizer.state_dict(), "scheduler": rt.scheduler.state_dict()},
            tmp / "optimizer" / f"rank_{rank:05d}.pt",
        )
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            (tmp / "trainer_state.json").write_text(
                json.dumps({**trainer_state, "world_size": dist.get_world_size()}, indent=2, default=_json_default)
            )
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = self.root / "latest.tmp"
            marker_tmp.write_text(final.name)
            os.replace(marker_tmp, self.root / "latest")
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, rt) -> dict:
        """Restores model, optimizer, schedule and RNG states; returns the trainer state."""
        state = json.loads((path / "trainer_state.json").read_text())
        if state.get("world_size") != dist.get_world_size():
            raise RuntimeError(
                f"{path} was written by {state.get('world_size')} ranks but this run has {dist.get_world_size()}: "
                "optimizer state resumes only in the same layout (load the model alone with model.load=...)"
            )
        rank = dist.get_rank()
        # Model first (master weights follow it), then the optimizer state, which restores the exact fp32 master
        # weights of a bf16 run (Float16OptimizerWithFloat16Params.load_state_dict copies its saved main params).
        rt.load_weights(path)
        opt = torch.load(path / "optimizer" / f"rank_{rank:05d}.pt", weights_only=False)
        rt.optimizer.load_state_dict(opt["optimizer"])
        rt.scheduler.load_state_dict(opt["scheduler"])
        _set_rng_state(torch.load(path / "rng" / f"rank_{rank:05d}.pt", weights_only=False))
        return state


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__} in trainer state")
