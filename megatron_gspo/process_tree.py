"""Processes the trainer starts end with it, even when it is SIGKILLed (the OOM killer, a lost node).

Standard library only: it is imported by the processes it is for (megatron's spawned results-queue manager
among them), which should not import torch to learn when to exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})
"""Ctrl-C's, Slurm's stop / preemption and requeue signals: they reach every process of a job step (scancel
signals them all; a terminal the whole process group), helpers the trainer spawned included. The trainer decides
when to stop and still needs its helpers (reward workers, the checkpoint results queue) for the step it
finishes: they ignore these (`ignore_stop_signals`)."""


@contextlib.contextmanager
def stop_signals_blocked():
    """Around the spawn of a helper that will ignore STOP_SIGNALS: blocked in the calling thread, so the child
    (fork + exec keep the signal mask) starts with them blocked until `ignore_stop_signals`, instead of dying of
    one in the 0.1-1 s its interpreter takes to get there (CI at 3c6a38f: a scancel's SIGTERM killed a starting
    reward worker and the run failed instead of writing its stop checkpoint). Other threads, the main one with
    the trainer's handlers among them, still take them; one aimed at this thread waits until the block ends."""
    # multiprocessing's spawn starts its resource tracker on first use, blocking SIGINT / SIGTERM around that and
    # UNBLOCKING them after (CPython 3.11 resource_tracker.ensure_running): inside our block that would unblock
    # them for the first helper. Started here first, it is a no-op inside (found in review).
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def ignore_stop_signals() -> None:
    """In a helper spawned under `stop_signals_blocked`: ignores STOP_SIGNALS, then unblocks them (one that came
    meanwhile is pending and, ignored now, dropped)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def start_helper(parent_pid: int) -> None:
    """First thing a spawned helper of the trainer does: ignore the stop signals and die with the trainer."""
    ignore_stop_signals()
    die_with_parent(parent_pid)


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits (prctl PR_SET_PDEATHSIG; strictly, when the
    thread that forked it does: the trainer's and the writer's main threads), and it exits now if the parent is
    already gone. A writer outliving its rank (SIGKILLed, OOM-killed) would go on writing into a checkpoint
    directory nobody will complete; a per-file process outliving its writer waits forever for a queue item the
    writer never sent, holding the job's stdout open. Elsewhere a no-op (abort still kills them)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
