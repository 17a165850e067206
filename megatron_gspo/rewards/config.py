"""How rewards are computed and when failing rewards stop a run (the `scoring.*` keys of a run config)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ScoringConfig:
    """Reward scoring: worker processes with a per-call timeout, and the error rate a training step tolerates."""

    workers: int = 2
    """Worker processes per rank that run the reward function (0: call it in the trainer process, without a
    timeout). Functions that cannot be sent to a worker (lambdas, closures) always run in-process."""
    timeout_s: float = 30.0
    """Seconds one reward call may take; a call past it is abandoned (its worker is killed) and counts as an error."""
    max_error_frac: float = 1.0
    """A training step whose fraction of failed reward calls (exceptions, timeouts, non-numbers, NaN), over all
    ranks and top-up rounds, reaches this fails the run with the first error's message (1.0: only when every call
    fails)."""
    slow_warning_s: float = 10.0
    """Reward calls running longer than this are reported while they run (how many are in flight, the oldest's
    age), again every `slow_warning_s` seconds while scoring lasts, long before `trainer.hang_warning_s` (0: never).
    Workers only: an in-process reward is not watched."""

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            raise ValueError(f"scoring.workers={self.workers!r} must be an integer >= 0 (0: in-process, no timeout)")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"scoring.timeout_s={self.timeout_s!r} must be a number of seconds > 0")
        if not (isinstance(self.max_error_frac, (int, float)) and 0 < self.max_error_frac <= 1):
            raise ValueError(f"scoring.max_error_frac={self.max_error_frac!r} must be in (0, 1]")
        if not (isinstance(self.slow_warning_s, (int, float)) and math.isfinite(self.slow_warning_s)
                and self.slow_warning_s >= 0):
            raise ValueError(f"scoring.slow_warning_s={self.slow_warning_s!r} must be a number of seconds >= 0 "
                             "(0: no report)")
