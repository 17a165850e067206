"""Rank functions of the asynchronous-checkpoint tests (trainer.async_save): megatron's real forked writers, on
gloo, in the layout given (EP=2: both ranks write model and optimizer files, the dense optimizer state only DP
rank 0)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import weakref
from pathlib import Path

from tests.training.resume_layout_ranks import COMMON, EXAMPLE, _state


@contextlib.contextmanager
def slow_writers(seconds: float, fail_on_rank: int | None = None, pid_file: str | None = None, how: str = "writer"):
    """megatron's tensor-file writer processes (forked from this one, so they inherit the patch) wait `seconds`
    before writing. On rank `fail_on_rank`, by `how`: `writer`: their disk is full (tests/checkpoint/full_disk.py:
    the writes of their .distcp files fail with ENOSPC inside megatron's writer, which reports it as it would a
    real one); `killed`: the first of them is SIGKILLed (what the kernel's OOM killer does), which megatron's
    writer never learns; `writer-killed`: megatron's writer process, their parent, is."""
    import signal

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from tests.checkpoint.full_disk import fill_disk

    original = FileSystemWriterAsync.write_preloaded_data
    failing = dist.get_rank() == fail_on_rank

    def write(*args, **kwargs):
        if pid_file is not None:  # each of megatron's per-file writer processes says who it is
            with open(pid_file, "a") as fh:
                fh.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        if failing and how != "writer" and kwargs.get("local_proc_idx") == 0:
            os.kill(os.getpid() if how == "killed" else os.getppid(), signal.SIGKILL)
        if failing and how == "writer":
            fill_disk(".distcp")  # in the writer process only
        original(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write)
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(original)


@contextlib.contextmanager
def full_disk_here(fragment: str):
    """This process's writes of files whose path contains `fragment` fail with ENOSPC (tests/checkpoint/full_disk.py)."""
    from tests.checkpoint.full_disk import fill_disk, free_disk

    fill_disk(fragment)
    try:
        yield
    finally:
        free_disk()


def _trainer(run_dir: str, extra=(), resume: bool = False):
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.trainer import GSPOTrainer

    cfg = load_run_config(EXAMPLE, [*COMMON, f"trainer.run_dir={run_dir}", "trainer.async_save=true", *extra])
    return GSPOTrainer(cfg, resume=resume)


def _next_group() -> None:
    # A process group on the port of a destroyed one waits for the old store: the next trainer uses the next port.
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)


def _entries(root) -> list[str]:
    return sorted(os.listdir(root)) if root.is_dir() else []


@contextlib.contextmanager
def hashing_pids(path: Path):
    """Appends the pid of each process that hashes a rank's checkpoint files (integrity.record_rank_files, as the
    checkpoint manager calls it) to `path`."""
    from megatron_gspo.checkpoint import manager

    original = manager.record_rank_files

    def record(root, rank, **kwargs):
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        original(root, rank, **kwargs)

    manager.record_rank_files = record
    try:
        yield
    finally:
        manager.record_rank_files = original


def save_while_training(run_dir: str, extra=()) -> dict:
    """Step 1's checkpoint is started in the background (its writers slowed down), the next update runs while it
    is written, then it is waited for; a new trainer resumes from it. Returns the states to compare and what the
    checkpoint directory showed at each point."""
    import torch.distributed as dist

    trainer = _trainer(run_dir, extra)
    root = trainer.ckpt.root
    seen: dict = {"device": str(trainer.rt.device)}
    try:
        batch, _ = trainer.collect(step_seed=123)
        trainer.old_logprobs(batch)
        trainer.update(batch)
        trainer.step = 1
        refs: list = []
        hashers = Path(run_dir) / f"hashed_by_rank{dist.get_rank()}"
        with slow_writers(3.0), staged_copies(refs), hashing_pids(hashers):
            path = trainer.checkpoint(background=True)
            gc.collect()
            seen["staged"] = len(refs)
            seen["staged_alive"] = sum(r() is not None for r in refs)  # while the writer reads them
            seen["in_flight"] = trainer.ckpt.in_flight
            saved = _state(trainer)
            trainer.update(batch)  # changes weights, masters and moments while the writers run
            after = _state(trainer)
            seen["poll"] = trainer.ckpt.poll()  # the writers still sleep: not complete, nothing renamed
            seen["while_writing"] = _entries(root)
            seen["latest_while_writing"] = trainer.ckpt.find_latest()
            dist.barrier()
            done = trainer.ckpt.wait()
        gc.collect()
        seen["staged_released"] = sum(r() is None for r in refs)
        seen["done"] = str(done) if done else None
        seen["path"] = str(path)
        seen["after_wait"] = _entries(root)
        seen["latest"] = (root / "latest").read_text().strip()
        seen["hashed_by"] = [int(x) for x in hashers.read_text().split()]
        seen["pid"] = os.getpid()
        record = root / "iter_0000001" / "integrity" / f"rank_{dist.get_rank():05d}.json"
        seen["record"] = sorted(json.loads(record.read_text())["files"])
    finally:
        trainer.close()
    _next_group()
    trainer = _trainer(run_dir, extra, resume=True)
    try:
        resumed = _state(trainer)
    finally:
        trainer.close()
    return dict(saved=saved, after=after, resumed=resumed, **seen)


@contextlib.contextmanager
def staged_copies(refs: list):
    """The staging hands the writer new tensors, as a GPU's device-to-host copy does (on a CPU megatron's staging
    returns the tensors themselves), and `refs` gets a weak reference to each."""
    from megatron_gspo.checkpoint import async_writes

    original = async_writes._stage_parts

    def stage(parts):
        out = []
        for buckets in original(parts):
            copied = []
            for file_name, storage_key, (bytes_data, tensor_data) in buckets:
                tensors = [(item, t.clone()) for item, t in tensor_data]
                refs.extend(weakref.ref(t) for _, t in tensors)
                copied.append((file_name, storage_key, (bytes_data, tensors)))
            out.append(copied)
        return out

    async_writes._stage_parts = stage
    try:
        yield
    finally:
        async_writes._stage_parts = original


@contextlib.contextmanager
def failing_start(on_rank: int):
    """Staging the tensors for the writer fails on rank `on_rank` (as a device-to-host copy that runs out of host
    memory would), after the other ranks' writers have started."""
    import torch.distributed as dist

    from megatron_gspo.checkpoint import async_writes

    original = async_writes._stage_parts

    def stage(parts):
        if dist.get_rank() == on_rank:
            time.sleep(1.0)
            raise MemoryError("staging the checkpoint tensors in host memory failed")
        return original(parts)

    async_writes._stage_parts = stage
    try:
        yield
    finally:
        async_writes._stage_parts = original


def failing_writers(run_dir: str, cases, extra=()) -> list[dict]:
    """Checkpoint 1 completes; then, for each `(rank, what)` case in turn on the same trainer, checkpoint N fails on
    `rank` (`writer`: its writers hit ENOSPC; `killed`: one of them is SIGKILLed; `writer-killed`: megatron's writer is; `start`: the start of its writer
    fails; otherwise a full disk for the file `what`) and checkpoint N+1 must work. What every rank saw,
    per case."""
    import torch.distributed as dist

    from megatron_gspo.checkpoint.manager import CheckpointWriteError

    trainer = _trainer(run_dir, extra)
    root = trainer.ckpt.root
    seen: list[dict] = []
    try:
        trainer.step = 1
        trainer.checkpoint(background=True)
        trainer.ckpt.wait()
        for fail_on_rank, what in cases:
            trainer.step += 1
            pid_file = f"{run_dir}/writers_{trainer.step}_{dist.get_rank()}"
            if what == "start":  # the writer the other rank started is still running when the failure is known
                failing = contextlib.ExitStack()
                failing.enter_context(slow_writers(3.0, pid_file=pid_file))
                failing.enter_context(failing_start(fail_on_rank))
            elif what in ("writer", "killed", "writer-killed"):
                failing = slow_writers(1.0, fail_on_rank=fail_on_rank, pid_file=pid_file, how=what)
            else:  # a full disk for one file: rank 0's in megatron's finalize functions, before a collective, or
                # one of the distributed optimizer's files
                failing = full_disk_here(what) if dist.get_rank() == fail_on_rank else contextlib.nullcontext()
            with failing:
                try:
                    trainer.checkpoint(background=True)  # `start` fails here, the others at the wait
                    if what == "killed":  # found by the polls at step boundaries (collective), not by a wait
                        while trainer.ckpt.poll() is None:
                            time.sleep(0.1)
                    else:
                        trainer.ckpt.wait()
                    error = None
                except CheckpointWriteError as err:
                    error = str(err)
            dist.barrier()
            in_flight = trainer.ckpt.in_flight
            # What a writer that was killed had reported must not be read by the next checkpoint's finalize (the
            # parts' results are read from this one queue in turn; file names repeat, so stale ones look valid).
            from megatron.core.dist_checkpointing.strategies import filesystem_async

            queue = filesystem_async._results_queue
            stale = queue.qsize() if queue is not None else 0
            trainer.step += 1  # the next checkpoint works again (nothing stale is read from megatron's result queue)
            trainer.checkpoint(background=True)
            next_one = trainer.ckpt.wait()
            import psutil

            pids = Path(pid_file)
            writers = [int(p) for p in pids.read_text().split()] if pids.is_file() else []
            survivors = [p for p in writers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
            seen.append(dict(error=error, in_flight=in_flight, stale=stale, next=str(next_one), step=trainer.step,
                             writers=len(writers), survivors=survivors, entries=_entries(root),
                             latest=(root / "latest").read_text().strip()))
            dist.barrier()  # every rank has looked before any starts the next case's checkpoint
        return seen
    finally:
        trainer.close()
