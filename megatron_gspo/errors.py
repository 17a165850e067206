"""How a run ends other than by finishing: the exceptions the CLI turns into one line and an exit code, and
`describe`, the one-line form of any error (used wherever a low-level error is reported to users).

ValueError / FileNotFoundError stay what they are everywhere (bad input: exit 2); these two are the others.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# Below this much free space on the file system a write failed on, the failure is reported as a full disk.
NEARLY_FULL_BYTES = 1 << 30


class RunFailure(RuntimeError):
    """The run cannot go on (failing rewards, a dead policy, a checkpoint that could not be written); its message
    is one line saying what happened and what to do. Exit code 1."""


class StopRequested(Exception):
    """A stop signal (SIGTERM, SIGUSR1) was honoured: the step finished and a checkpoint was written. Exit code 75
    (EX_TEMPFAIL): try again later with --resume; the Slurm scripts requeue the job on it."""

    def __init__(self, message: str, signal_name: str, step: int):
        super().__init__(message)
        self.signal_name = signal_name
        self.step = step


class RankFailed(RuntimeError):
    """Raised on the other ranks when `rank` failed at a step all ranks take together (so that none goes on into
    the next collective alone); `line` is that rank's one-line description of its failure."""

    def __init__(self, what: str, rank: int, line: str):
        super().__init__(f"{what} failed on rank {rank}: {line}")
        self.what, self.rank, self.line = what, rank, line

    def __reduce__(self):
        return type(self), (self.what, self.rank, self.line)


def first_failure(error: BaseException) -> tuple[int, BaseException] | None:
    """(rank, exception) of the first rank in torch.distributed.checkpoint's CheckpointException (which holds
    every rank's failures, raised on every rank); None for any other error."""
    failures = getattr(error, "failures", None)
    if not (isinstance(failures, dict) and failures):
        return None
    rank, wrapped = next(iter(failures.items()))
    return rank, (wrapped[0] if isinstance(wrapped, tuple) else wrapped)


def describe(error: BaseException, written: str | os.PathLike | None = None) -> str:
    """One line for an error: "No space left on device (...)" whenever ENOSPC is anywhere in its chain (torch's
    checkpoint writers wrap it), else `Type: message`'s first line; torch.distributed.checkpoint's
    CheckpointException (every rank's failures) as "CheckpointException on rank K: <rank K's failure>".

    `written`: the path that was being written. megatron's checkpoint writer processes send their exception back
    through a multiprocessing queue, and pickling drops its chain: a full disk then arrives as torch's "[enforce
    fail at inline_container.cc] unexpected pos ..." alone. So when that path's file system has under
    `NEARLY_FULL_BYTES` free, the line starts with "No space left on device?" and says how much is free."""
    first = first_failure(error)
    if first is not None:
        return f"{type(error).__name__} on rank {first[0]}: {describe(first[1], written)}"
    for exc in _chain(error):
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return f"No space left on device ({_first_line(exc)})"
    line = _first_line(error)
    free = None if written is None else free_bytes(written)
    if free is not None and free < NEARLY_FULL_BYTES:
        return f"No space left on device? ({free / 2**20:.1f} MiB free on the file system of {written}; {line})"
    return line


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes (for this user) on the file system holding `path` or its nearest existing parent; None if
    unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _chain(error: BaseException):
    seen: set[int] = set()
    todo = [error]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo += [exc.__cause__, exc.__context__]
        # torch.distributed.checkpoint.CheckpointException keeps every rank's exception in `failures`.
        for wrapped in (getattr(exc, "failures", None) or {}).values():
            todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
