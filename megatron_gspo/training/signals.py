"""Stop signals: SIGTERM (scancel, preemption, `kill`) and SIGUSR1 (what launch/train.sbatch asks Slurm to send
before the time limit) become a request to stop after the current RL step, with a checkpoint.

The handler only records the signal; the trainer asks `requested()` at each step boundary, where all ranks agree
through one collective (a signal can reach ranks at different moments, or only some of them), so every rank stops
after the same step. A second signal of the same kind ends the process at once (the default action).
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
        name = signal.Signals(signum).name
        if self.received == name:
            # Asked twice: stop now, the way the signal would have without us.
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if self.received is None:
            self.received = name
            log.warning("received %s: stopping after this RL step, with a checkpoint (send it again to stop now)", name)

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
