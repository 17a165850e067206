"""How a run ends other than by finishing: the exceptions the CLI turns into one line and an exit code, and
`describe`, the one-line form of any error (used wherever a low-level error is reported to users).

ValueError / FileNotFoundError stay what they are everywhere (bad input: exit 2); these two are the others.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

# A write that failed without saying why (its ENOSPC lost, see `describe`) is reported as a full disk when its file
# system has less than this free (or under 1% of its size, whichever is less).
NEARLY_FULL_BYTES = 1 << 30
_LOST_WRITE = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed|Worker failure")
_FULL = (errno.ENOSPC, errno.EDQUOT)


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


def rank_failures(error: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) for each rank in the first torch.distributed.checkpoint CheckpointException of `error`'s
    chain (it holds every failing rank's exception; torch raises it on every rank). Its ranks are those of DCP's
    process group: megatron-core 0.16.1 saves with the default group, so they are global ranks."""
    for exc in _chain(error):
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures:
            return [(rank, wrapped[0] if isinstance(wrapped, tuple) else wrapped) for rank, wrapped in failures.items()]
    return []


def describe(error: BaseException, written: str | os.PathLike | None = None) -> str:
    """One line for an error: "No space left on device (...)" (or "Disk quota exceeded") whenever that errno is
    anywhere in its chain (torch's checkpoint writers wrap it), else `Type: message`'s first line; a
    torch.distributed.checkpoint CheckpointException as "CheckpointException on rank K: <rank K's failure>", a
    full disk's rank first.

    `written`: the path that was being written. megatron's checkpoint writer processes send their exception back
    through a multiprocessing queue, and pickling drops its chain: a full disk then arrives as torch's "[enforce
    fail at inline_container.cc] unexpected pos ..." alone. Such a write error on a file system that is nearly
    full (`NEARLY_FULL_BYTES`) starts with "No space left on device?" and says how much is free."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        lines = [(rank, describe(exc, written)) for rank, exc in rank_failures(error)]
        rank, line = next(((r, m) for r, m in lines if _says_full(m)), lines[0])
        return f"{type(error).__name__} on rank {rank}: {line}"
    for exc in _chain(error):
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return f"{os.strerror(exc.errno)} ({_first_line(exc)})"
    line = _first_line(error)
    if written is not None and _LOST_WRITE.search(line) and not any(
        isinstance(exc, OSError) and exc.errno for exc in _chain(error)
    ):
        free = nearly_full(written)
        if free is not None:
            return f"No space left on device? ({free / 2**20:.1f} MiB free on the file system of {written}; {line})"
    return line


def nearly_full(path: str | os.PathLike) -> int | None:
    """The free bytes (for this user) on the file system holding `path` (or its nearest existing parent) if that
    is under `NEARLY_FULL_BYTES` and under 1% of its size; None if not, or unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free if usage.free < min(NEARLY_FULL_BYTES, usage.total / 100) else None


def _says_full(line: str) -> bool:
    return line.startswith(tuple(os.strerror(code) for code in _FULL))


def _chain(error: BaseException):
    seen: set[int] = set()
    todo = [error]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        # Not into a CheckpointException's `failures`: those are other ranks' (rank_failures, describe).
        todo += [exc.__cause__, exc.__context__]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
