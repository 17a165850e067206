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

One writer process, parts in order, because megatron's writers report their results through one shared queue per
process (`filesystem_async._results_queue`) that each part's finalize reads in turn: two writers in flight at once
could hand one part the other's results. For the same reason at most one request is in flight (the caller waits
for the previous checkpoint before it starts the next).
"""

from __future__ import annotations

import contextlib
import queue
from functools import partial

import psutil
import torch.distributed as dist


def _write_parts(parts: list, rank: int, staged: list, _unused) -> None:
    """The writer process: each part's own write function on the tensors staged for it, in order."""
    for request, buckets in zip(parts, staged):
        args = list(request.async_fn_args)
        args[1] = buckets  # megatron's convention: argument 1 is the write buckets the staging returns
        request.async_fn(*args, **request.async_fn_kwargs)


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


def merged_request(requests: list):
    """One AsyncRequest doing what `requests` (dist_io.dist_save's) do, in order, its staging held (`_Staged`),
    and the DeferredFailures of the parts (None entries: parts written synchronously)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    requests = [r for r in requests if r is not None]
    deferred = [fn.__self__ for r in requests for fn in r.finalize_fns if _is_deferred(fn)]
    finalize = [fn for r in requests for fn in r.finalize_fns if not _is_deferred(fn)]
    parts = [r for r in requests if r.async_fn is not None]  # a rank with nothing to write in a part has None
    if not parts:
        return AsyncRequest(None, (), finalize), None, deferred
    staged = _Staged(parts)
    request = AsyncRequest(partial(_write_parts, parts), (dist.get_rank(), None, None), finalize, preload_fn=staged)
    return request, staged, deferred


def _is_deferred(fn) -> bool:
    return isinstance(getattr(fn, "__self__", None), DeferredFailures)


class AsyncWrites:
    """The checkpoint write in flight on this rank (at most one), on megatron's AsyncCallsQueue."""

    def __init__(self) -> None:
        self._queue = None
        self._staged: _Staged | None = None
        self._deferred: list[DeferredFailures] = []

    @property
    def pending(self) -> bool:
        return self._queue is not None and self._queue.get_num_unfinalized_calls() > 0

    def start(self, requests: list) -> None:
        """Stages and forks the writer for `requests` (every rank calls, one request list per checkpoint)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self.pending:
            raise RuntimeError("a checkpoint write is still in flight: finish it first")
        request, self._staged, self._deferred = merged_request(requests)
        self._queue = self._queue or AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(request)

    def finish(self, blocking: bool) -> bool:
        """True when nothing is in flight any more on any rank and megatron's finalize functions ran (every rank
        calls; one all-reduce when not blocking). Raises what megatron's finalize raises (on every rank), or on
        rank 0 what its own writes in them raised (DeferredFailures; the caller makes every rank agree)."""
        if not self.pending:
            return True
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:
            self._release()
            raise
        if self.pending:
            return False
        deferred = self._deferred
        self._release()
        for failures in deferred:
            failures.raise_first()
        return True

    def abort(self) -> None:
        """Kills this rank's writer process (no collective) and forgets the request; results it may have reported
        are drained so that the next checkpoint's finalize does not read them."""
        if self._queue is not None:
            for call in list(self._queue.async_calls):
                process = getattr(call.async_caller, "process", None)
                helpers = _stop_helpers(process)
                call.async_caller.close(abort=True)  # SIGKILL
                for helper in helpers:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        helper.kill()
                if process is not None:
                    process.join(timeout=10)
            self._queue = None
            _drain_results()
        self._release()

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
        self._staged = None
        self._deferred = []


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
