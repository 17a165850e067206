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

import queue
from functools import partial

import torch.distributed as dist


def _write_parts(parts: list, rank: int, staged: list, _unused) -> None:
    """The writer process: each part's own write function on the tensors staged for it, in order."""
    for request, buckets in zip(parts, staged):
        args = list(request.async_fn_args)
        args[1] = buckets  # megatron's convention: argument 1 is the write buckets the staging returns
        request.async_fn(*args, **request.async_fn_kwargs)


def _stage_parts(parts: list) -> list:
    return [r.preload_fn() if r.preload_fn is not None else r.async_fn_args[1] for r in parts]


def merged_request(requests: list):
    """One AsyncRequest doing what `requests` do, in order (None entries: parts written synchronously)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    requests = [r for r in requests if r is not None]
    parts = [r for r in requests if r.async_fn is not None]  # a rank with nothing to write in a part has None
    finalize = [fn for r in requests for fn in r.finalize_fns]
    if not parts:
        return AsyncRequest(None, (), finalize)
    return AsyncRequest(
        partial(_write_parts, parts),
        (dist.get_rank(), None, None),
        finalize,
        preload_fn=partial(_stage_parts, parts),
    )


class AsyncWrites:
    """The checkpoint write in flight on this rank (at most one), on megatron's AsyncCallsQueue."""

    def __init__(self) -> None:
        self._queue = None

    @property
    def pending(self) -> bool:
        return self._queue is not None and self._queue.get_num_unfinalized_calls() > 0

    def start(self, requests: list) -> None:
        """Stages and forks the writer for `requests` (every rank calls, one request list per checkpoint)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self.pending:
            raise RuntimeError("a checkpoint write is still in flight: finish it first")
        self._queue = self._queue or AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(merged_request(requests))

    def finish(self, blocking: bool) -> bool:
        """True when nothing is in flight any more on any rank and megatron's finalize functions ran (every rank
        calls; one all-reduce when not blocking). Raises what megatron's finalize raises (on every rank)."""
        if not self.pending:
            return True
        self._queue.maybe_finalize_async_calls(blocking=blocking)
        return not self.pending

    def abort(self) -> None:
        """Kills this rank's writer process (no collective) and forgets the request; results it may have reported
        are drained so that the next checkpoint's finalize does not read them."""
        if self._queue is None:
            return
        for call in list(self._queue.async_calls):
            process = getattr(call.async_caller, "process", None)
            call.async_caller.close(abort=True)  # SIGKILL
            if process is not None:
                process.join(timeout=10)
        self._queue = None
        _drain_results()


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
