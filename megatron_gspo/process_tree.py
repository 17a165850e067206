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
