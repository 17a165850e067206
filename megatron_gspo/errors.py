"""How a run ends other than by finishing: the exceptions the CLI turns into one line and an exit code, and
`describe`, the one-line form of any error (used wherever a low-level error is reported to users).

ValueError / FileNotFoundError stay what they are everywhere (bad input: exit 2); these two are the others.
"""

from __future__ import annotations

import errno


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


def describe(error: BaseException) -> str:
    """One line for an error: "No space left on device (...)" whenever ENOSPC is anywhere in its chain (torch's
    checkpoint writers wrap it), else `Type: message`'s first line."""
    for exc in _chain(error):
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return f"No space left on device ({_first_line(exc)})"
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"{type(error).__name__} on rank {rank}: {_first_line(inner)}"
    return _first_line(error)


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
