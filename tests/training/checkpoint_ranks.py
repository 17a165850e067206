"""Checkpoint checks run in spawned ranks with a real (tiny) trainer: durability order, a full disk on one rank."""

from __future__ import annotations

import os
from pathlib import Path

from tests.training.test_end_to_end import MINI


def _trainer(run_dir: str, extra=()):
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config("examples/tiny_moe_gspo.yaml", [*MINI, f"trainer.run_dir={run_dir}", *extra])
    return GSPOTrainer(cfg)


def save_events(run_dir: str) -> dict:
    """Records every fsync (by path) and rename while the trainer writes a checkpoint."""
    trainer = _trainer(run_dir)
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return real_replace(src, dst, **kwargs)

    os.fsync, os.replace = fsync, replace
    try:
        trainer.step = 1
        path = trainer.checkpoint()
    finally:
        os.fsync, os.replace = real_fsync, real_replace
        trainer.close()
    path = Path(path).resolve()
    return dict(events=events, path=str(path), entries=sorted(str(p.relative_to(path)) for p in path.rglob("*")))


def disk_full_on_one_rank(run_dir: str, fragment: str, rank_full: int, extra=()) -> dict:
    """Checkpoint 1 is written; while checkpoint 2 is written, rank `rank_full`'s disk is full for files whose
    path contains `fragment`."""
    import torch.distributed as dist

    from megatron_gspo.training.checkpoint import CheckpointWriteError
    from tests.training.full_disk import fill_disk, free_disk

    trainer = _trainer(run_dir, extra)
    root = trainer.ckpt.root
    try:
        trainer.step = 1
        trainer.checkpoint()
        trainer.step = 2
        if dist.get_rank() == rank_full:
            fill_disk(fragment)
        try:
            trainer.checkpoint()
            error = None
        except CheckpointWriteError as err:
            error = str(err)
        finally:
            free_disk()
        dist.barrier()
        return dict(
            error=error,
            entries=sorted(os.listdir(root)),
            latest=(root / "latest").read_text().strip(),
            state=trainer.ckpt.find_latest()[1]["step"],
        )
    finally:
        trainer.close()
