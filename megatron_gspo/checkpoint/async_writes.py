"""The asynchronous part of a checkpoint save: the tensor files megatron's forked writers are still writing.

`dist_io.dist_save(..., asynchronous=True)` plans a dist_checkpointing save and returns megatron's `AsyncRequest`
(a function that writes this rank's tensor files, the function that stages them in host memory first, and the
finalize functions that write the DCP `.metadata` and `metadata.json` once every rank is done). A trainer
checkpoint has two of them (model/ and optimizer/); `AsyncWrites` runs them as one request on megatron's
`AsyncCallsQueue`:

  start(requests)   stages the tensors (device -> host on a GPU) and forks ONE writer process that writes the
                    parts one after the other. The fork is the snapshot: on a CPU the child sees the tensors as
                    they were at the fork (copy-on-write), on a GPU the host copies made by the staging; training
                    may change the live tensors right after `start` returns.
  finish(blocking)  (every rank, at the same point) True once the writer of every rank has exited and the finalize
                    functions have run. A writer that failed or died makes megatron's finalize raise
                    `CheckpointException` on every rank (its broadcast of the failure).
  abort()           kills the writer process without any collective (a start that failed on some rank, a run
                    that is going down).

megatron's writer forks one process per file and waits for each to mark its task done; one that dies without it
(SIGKILLed by the kernel's OOM killer while it copies its file) leaves the writer waiting forever. `finish`
watches for that: it kills such a writer, and the checkpoint fails on every rank naming the signal (as it does
for a writer that was itself killed), instead of the run hanging at its next wait. A writer that neither ends nor
loses a process -- deadlocked, or stopped (SIGSTOP) -- shows no such sign: with a `timeout_s`, `finish` kills the
writer still running that long after its start, and the checkpoint fails the same way, naming the timeout.

One writer process, parts in order, because megatron's writers report their results through one shared queue per
process (`filesystem_async._results_queue`) that each part's finalize reads in turn: two writers in flight at once
could hand one part the other's results. For the same reason at most one request is in flight (the caller waits
for the previous checkpoint before it starts the next).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from functools import partial

import psutil
import torch.distributed as dist

from megatron_gspo.process_tree import die_with_parent as _die_with_parent
from megatron_gspo.process_tree import start_helper, stop_signals_blocked


def _write_parts(parts: list, trainer_pid: int, after, rank: int, staged: list, _unused) -> None:
    """The writer process: each part's own write function on the tensors staged for it, in order, then `after()`
    (the integrity record of the files written). It and the per-file processes megatron forks from it die with
    their parent (`_die_with_parent`)."""
    _die_with_parent(trainer_pid)
    writer_pid = os.getpid()
    os.register_at_fork(after_in_child=lambda: _die_with_parent(writer_pid))
    for request, buckets in zip(parts, staged):
        args = list(request.async_fn_args)
        args[1] = buckets  # megatron's convention: argument 1 is the write buckets the staging returns
        request.async_fn(*args, **request.async_fn_kwargs)
    if after is not None:
        after()




def results_queue_dying_with_us() -> None:
    """Creates megatron's per-process queue of writer results (`filesystem_async._results_queue`) before megatron
    does, served by a manager process that dies with this one. megatron starts a plain `Manager()` (spawned), which
    outlives a SIGKILLed trainer, reparented to init; so does the multiprocessing resource tracker, whose pipe the
    manager holds open: both kept the job's stdout / stderr open (a `| tee` never saw EOF). Once the manager dies
    with the trainer, the tracker reads EOF and exits too."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    # process_tree: stdlib only, no torch in the manager. It ignores the job's stop signals (Slurm's SIGTERM
    # reaches it too; the trainer's stop checkpoint still needs the queue), blocked from its spawn on.
    with stop_signals_blocked():
        manager.start(start_helper, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()


def _stage_parts(parts: list) -> list:
    return [r.preload_fn() if r.preload_fn is not None else r.async_fn_args[1] for r in parts]


class _Staged:
    """Holds the staged host copies until the writer is done. megatron hands them to the writer only as the
    fork's arguments, which the parent drops right after the fork; on a GPU they are pinned (a non-blocking D2H
    copy), and PyTorch's pinned allocator may give freed blocks to the next pinned allocation (the colocated
    offload makes some at once), which the writer, reading the parent's physical pages, would then write."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.copies: list | None = None

    def __call__(self) -> list:
        self.copies = _stage_parts(self.parts)
        return self.copies


class DeferredFailures:
    """Failures of the writes rank 0 alone does inside megatron's finalize functions (the DCP `.metadata`,
    metadata.json), kept to be raised after all of them ran: raising there skips the collective that follows
    (megatron broadcasts the writers' failure flag after rank 0 writes `.metadata`, and barriers after
    metadata.json), in which the other ranks would wait forever."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def guard(self, fn):
        """`fn` with its exception recorded instead of raised."""

        def guarded(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - raised by `raise_first` once the collectives are done
                self.errors.append(err)

        return guarded

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]


def merged_request(requests: list, after=None):
    """One AsyncRequest doing what `requests` (dist_io.dist_save's) do, in order, then `after()` in the writer
    process, its staging held (`_Staged`), and the DeferredFailures of the parts (None entries: parts written
    synchronously). With nothing to write in the background `after()` runs now."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    requests = [r for r in requests if r is not None]
    deferred = [fn.__self__ for r in requests for fn in r.finalize_fns if _is_deferred(fn)]
    finalize = [fn for r in requests for fn in r.finalize_fns if not _is_deferred(fn)]
    parts = [r for r in requests if r.async_fn is not None]  # a rank with nothing to write in a part has None
    if not parts:
        if after is not None:
            after()
        return AsyncRequest(None, (), finalize), None, deferred
    staged = _Staged(parts)
    write = partial(_write_parts, parts, os.getpid(), after)
    request = AsyncRequest(write, (dist.get_rank(), None, None), finalize, preload_fn=staged)
    return request, staged, deferred


def _is_deferred(fn) -> bool:
    return isinstance(getattr(fn, "__self__", None), DeferredFailures)


class AsyncWrites:
    """The checkpoint write in flight on this rank (at most one), on megatron's AsyncCallsQueue."""

    def __init__(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"checkpoint writer timeout_s={timeout_s!r} must be > 0 (or None: no limit)")
        self.timeout_s = timeout_s
        """Seconds a writer may run after `start` before `finish` kills it (None: no limit)."""
        self._started: float | None = None
        self._queue = None
        self._staged: _Staged | None = None
        self._deferred: list[DeferredFailures] = []
        self._died: str | None = None  # why this rank's writer will never report (kept until the request ends)

    @property
    def pending(self) -> bool:
        return self._queue is not None and self._queue.get_num_unfinalized_calls() > 0

    def start(self, requests: list, after=None) -> None:
        """Stages and forks the writer for `requests` (every rank calls, one request list per checkpoint); the
        writer calls `after()` once it wrote them."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self.pending:
            raise RuntimeError("a checkpoint write is still in flight: finish it first")
        request, self._staged, self._deferred = merged_request(requests, after)
        self._queue = self._queue or AsyncCallsQueue(persistent=False)
        self._started = time.monotonic()
        self._queue.schedule_async_request(request)

    def finish(self, blocking: bool) -> bool:
        """True when nothing is in flight any more on any rank and megatron's finalize functions ran (every rank
        calls; one all-reduce when not blocking). Raises what megatron's finalize raises (on every rank), or on
        rank 0 what its own writes in them raised (DeferredFailures; the caller makes every rank agree)."""
        if not self.pending:
            return True
        died = self._died = self._died or self._watch_writer(blocking)
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as err:
            self._release()
            if died is not None:
                raise RuntimeError(died) from err
            raise
        if self.pending:
            return False
        deferred = self._deferred
        self._release()
        if died is not None:  # its results cannot all have arrived; never count such a checkpoint as written
            raise RuntimeError(died)
        for failures in deferred:
            failures.raise_first()
        return True

    def _watch_writer(self, blocking: bool) -> str | None:
        """Why this rank's writer will never report (None: it may). Kills a writer whose per-file process died
        without finishing (megatron's writer would wait for it forever); with `blocking`, watches until the
        writer has exited, so that megatron's join afterwards returns. A writer still running `timeout_s` after
        its start is killed too (a deadlock shows no other sign; megatron's join would wait for it forever)."""
        calls = list(self._queue.async_calls)
        process = getattr(calls[-1].async_caller, "process", None) if calls else None
        if process is None or process.pid is None:
            return None
        while process.is_alive():
            dead = _dead_helper(process.pid)
            if dead is not None:
                self._kill(calls[-1])
                return f"a checkpoint file writer process (pid {dead[0]}) {dead[1]}: its writer was stopped"
            if self._overdue():
                self._kill(calls[-1])
                return (f"the checkpoint writer process (pid {process.pid}) did not finish within {self.timeout_s:g} s "
                        "of its start (deadlocked or stopped?): it was killed; trainer.async_save_timeout_s sets "
                        "the limit")
            if not blocking:
                return None
            time.sleep(0.2)
        if process.exitcode is not None and process.exitcode < 0:
            return f"the checkpoint writer process (pid {process.pid}) {_ended(-process.exitcode)}"
        return None

    def _overdue(self) -> bool:
        return (self.timeout_s is not None and self._started is not None
                and time.monotonic() - self._started > self.timeout_s)

    def abort(self) -> None:
        """Kills this rank's writer process (no collective) and forgets the request; results it may have reported
        are drained so that the next checkpoint's finalize does not read them."""
        if self._queue is not None:
            for call in list(self._queue.async_calls):
                self._kill(call)
            self._queue = None
            _drain_results()
        self._release()

    @staticmethod
    def _kill(call) -> None:
        """SIGKILLs the writer process of `call` and the per-file processes it forked, and reaps the writer."""
        process = getattr(call.async_caller, "process", None)
        helpers = _stop_helpers(process)
        if process is not None and process.is_alive():
            process.kill()
        for helper in helpers:
            with contextlib.suppress(psutil.NoSuchProcess):
                helper.kill()
        if process is not None:
            process.join(timeout=10)

    def close(self) -> None:
        """`abort`, and shuts down megatron's results-queue manager process (spawned by the first asynchronous
        save of this process; megatron never stops it)."""
        self.abort()
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        results = filesystem_async._results_queue
        manager = getattr(results, "_manager", None)
        if manager is not None:
            manager.shutdown()
            filesystem_async._results_queue = None

    def _release(self) -> None:
        self._started = None
        self._staged = None
        self._deferred = []
        self._died = None


def _stop_helpers(process) -> list:
    """Freezes megatron's writer process and returns the per-file processes it forked. Killing the writer alone
    orphans them for good: they wait on a queue item the writer's feeder thread may never have sent, holding the
    job's stdout open."""
    if process is None or process.pid is None:
        return []
    try:
        writer = psutil.Process(process.pid)
        writer.suspend()  # no new ones while they are listed
        return writer.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _dead_helper(writer_pid: int) -> tuple[int, str] | None:
    """(pid, how it ended) of a per-file process of the writer that ended abnormally, or None. Ended ones stay
    zombies until the writer joins them, which it does only after all are done; their exit status is in
    /proc/<pid>/stat (Linux; elsewhere nothing is detected)."""
    try:
        helpers = psutil.Process(writer_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for helper in helpers:
        with contextlib.suppress(psutil.NoSuchProcess):
            if helper.status() != psutil.STATUS_ZOMBIE:
                continue
            status = _exit_status(helper.pid)
            if status:  # a normal exit is 0; the writer reads its result later
                return helper.pid, _ended_by_status(status)
    return None


def _exit_status(pid: int) -> int | None:
    """A zombie's wait status (field 52 of /proc/<pid>/stat), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[49])  # fields[0] is field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None


def _ended_by_status(status: int) -> str:
    signo = status & 0x7F
    return _ended(signo) if signo else f"exited with code {status >> 8}"


def _ended(signo: int) -> str:
    try:
        name = signal.Signals(signo).name
    except ValueError:
        name = f"signal {signo}"
    why = " (out of host memory? the kernel's OOM killer sends it)" if signo == signal.SIGKILL else ""
    return f"was killed by {name}{why}"


def _drain_results() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = filesystem_async._results_queue  # megatron's per-process queue of writer results (None: unused)
    while results is not None:
        try:
            results.get_nowait()
        except queue.Empty:
            break
        except (OSError, EOFError):  # the queue's manager process is gone: nothing left to read
            filesystem_async._results_queue = None
            break
