"""Checkpoint checks run in spawned ranks with a real (tiny) trainer: durability order, a full disk on one rank."""

from __future__ import annotations

import os
import sys
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

    from megatron_gspo.checkpoint.manager import CheckpointWriteError
    from tests.checkpoint.full_disk import fill_disk, free_disk

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


def killed_while_deleting_the_old_copy(root: str, phase: str) -> None:
    """`kill`: saves steps 4 and 5 (keep_last=1), then step 5 again (a stop on the last step, requeued, saves it
    once more), killed (os._exit, as SIGKILL) while the replaced copy is being deleted; `next`: the next save, of
    step 6. Run as `python -m tests.checkpoint.checkpoint_ranks ROOT PHASE`."""
    import shutil

    import torch.distributed as dist

    from megatron_gspo.checkpoint.manager import CheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{root}/pg_{phase}", rank=0, world_size=1)
    manager = CheckpointManager(Path(root) / "checkpoints", keep_last=1, run_id="run")
    steps = ((4, "four"), (5, "five"), (5, "five again")) if phase == "kill" else ((6, "six"),)
    for step, text in steps:
        if text == "five again":
            real = shutil.rmtree

            def killed(path, *args, **kwargs):
                if Path(path).name.startswith("iter_0000005.") and str(path).endswith(".trash"):
                    os._exit(137)
                return real(path, *args, **kwargs)

            shutil.rmtree = killed
        manager.save(step, lambda tmp, text=text: (tmp / "data.txt").write_text(text), {"step": step})


if __name__ == "__main__":
    killed_while_deleting_the_old_copy(sys.argv[1], sys.argv[2])
