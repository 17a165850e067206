"""Stop signals: SIGTERM (scancel, preemption, `kill`) and SIGUSR1 (what launch/train.sbatch asks Slurm to send
before the time limit) become a request to stop after the current RL step, with a checkpoint.

The handler only records the signal; the trainer asks `requested()` at each step boundary, where all ranks agree
through one collective (a signal can reach ranks at different moments, or only some of them), so every rank stops
after the same step. Further signals change nothing: Slurm signals every process of a job (and the launch scripts
pass signals on), so one stop request often arrives more than once. Ctrl-C (SIGINT) and SIGKILL stop at once.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Records the first stop signal this process receives while installed."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        """Installs the handlers (main thread only; elsewhere, e.g. in a test's worker thread, it does nothing)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.warning("received %s: stopping after this RL step, with a checkpoint", self.received)

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
