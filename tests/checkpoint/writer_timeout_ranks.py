"""Rank function of the checkpoint-writer timeout test (issue 25, item 8): an asynchronous save through the
trainer's CheckpointManager and megatron's real forked writers, one rank's writer deadlocked."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch


@contextlib.contextmanager
def stopped_file_writers(on_rank: int):
    """On rank `on_rank`, each of megatron's per-file writer processes (forked from the writer forked from this
    rank, so they inherit the patch) stops itself with SIGSTOP before writing: megatron's writer then waits for
    them forever, alive and silent -- a deadlock as the trainer sees it."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data
    stop = dist.get_rank() == on_rank

    def write(*args, **kwargs):
        if stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write)
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(original)


def save_with_a_stopped_writer(root: str, timeout_s: float, stop_on_rank: int, poll: bool) -> dict:
    """Checkpoint 1 with rank `stop_on_rank`'s writers stopped (found by `wait`, or by `poll`s at step
    boundaries), then checkpoint 2 without: {"error", "seconds" (to the error), "next", "children_left"}."""
    import psutil
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_gspo.checkpoint.dist_io import dist_save, rank0
    from megatron_gspo.checkpoint.manager import CheckpointManager, CheckpointWriteError
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    env = initialize(ParallelConfig(), seed=0)
    rank = torch.distributed.get_rank()
    # Only the stopped rank has the limit: a healthy writer may take longer than a short limit on a loaded machine.
    limit = timeout_s if rank == stop_on_rank else None
    manager = CheckpointManager(Path(root), keep_last=2, run_id="timeout", writer_timeout_s=limit)
    weight = torch.arange(16, dtype=torch.float32).view(2, 8) + 100 * rank

    def contents(tmp: Path):
        part = tmp / "part"
        rank0(lambda: part.mkdir(parents=True, exist_ok=True), f"creating {part}")
        state = {"w": ShardedTensor.from_rank_offsets("w", weight, (0, rank, env.world_size))}
        return [dist_save(state, str(part), asynchronous=True)]

    try:
        with stopped_file_writers(stop_on_rank):
            manager.save(1, contents, {"step": 1}, asynchronous=True)
            start, error = time.monotonic(), None
            try:
                if poll:
                    while manager.poll() is None:
                        time.sleep(0.1)
                else:
                    manager.wait()
            except CheckpointWriteError as err:
                error = str(err)
            seconds = time.monotonic() - start
        # The next checkpoint without a limit (a loaded machine may take longer than the short one for a healthy
        # write): what is tested is that the failed one left nothing in its way.
        manager.close()
        manager = CheckpointManager(Path(root), keep_last=2, run_id="timeout")
        manager.save(2, contents, {"step": 2}, asynchronous=True)
        next_one = manager.wait()
        left = [
            c.pid for c in psutil.Process().children(recursive=True) if c.status() == psutil.STATUS_STOPPED
        ]
        return dict(error=error, seconds=seconds, next=str(next_one), stopped_left=left)
    finally:
        manager.close()
        shutdown()
