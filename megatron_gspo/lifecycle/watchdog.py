"""Hang warnings: which phase of the RL step a rank has been in for too long.

A frozen or slow rank (a reward stuck in a loop, a dead rollout server, a rank-local top-up round) leaves the
others waiting in the next collective until the process-group timeout (`parallel.timeout_s`) fails the job. The
trainer marks each phase (`watchdog.mark("update")`); a daemon thread logs a warning, on every rank, once a
phase has run `threshold_s` seconds and again every `threshold_s` after that, so the logs show where each rank is
waiting and which rank is the slow one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger(__name__)


class PhaseWatchdog:
    """Warns when one phase lasts longer than `threshold_s` seconds (0 disables it)."""

    def __init__(self, threshold_s: float, rank: int = 0, timeout_s: float | None = None):
        self.threshold_s = float(threshold_s)
        self.rank = rank
        self.timeout_s = timeout_s
        self._current: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.threshold_s > 0:
            self._thread = threading.Thread(target=self._watch, name="phase-watchdog", daemon=True)
            self._thread.start()

    def mark(self, name: str | None) -> None:
        """From now on this rank is in phase `name` (None: outside any phase)."""
        self._current = None if name is None else (name, time.monotonic())

    @contextlib.contextmanager
    def phase(self, name: str):
        """Marks the enclosed code as phase `name`; afterwards the rank is outside any phase."""
        self.mark(name)
        try:
            yield
        finally:
            self.mark(None)

    def _watch(self) -> None:
        interval = min(max(self.threshold_s / 4, 0.05), 5.0)
        warned: tuple[str, float] | None = None
        reported = 0
        while not self._stop.wait(interval):
            current = self._current
            if current is None:
                continue
            name, start = current
            elapsed = time.monotonic() - start
            if current != warned:
                warned, reported = current, 0
            if elapsed >= self.threshold_s * (reported + 1):
                reported = int(elapsed // self.threshold_s)
                limit = f"; the process group times out after {self.timeout_s:g} s" if self.timeout_s else ""
                log.warning(
                    "rank %d: still in phase %r after %.0f s (warning every trainer.hang_warning_s=%g s): it waits "
                    "for a collective or a slow call; the rank that is not waiting is the slow one%s",
                    self.rank, name, elapsed, self.threshold_s, limit,
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
