"""Training-health checks: a run that goes on without learning says so (the `health.*` keys of a run config).

Two conditions, each reported as a per-step metric and, once it has held for a window of consecutive steps, as a
warning (and, with `health.stop`, as the end of the run):

- dead policy (`health_zero_grad`): the rollout batch carries learning signal (some advantage A_i != 0, Eq.6) but
  every minibatch's gradient norm is zero. A collapsed model (e.g. a learning rate far too high saturating the
  softmax) gives exactly this; GSPO's clipping alone cannot (the first minibatch is on-policy, s_i = 1).
- no learning signal (`health_no_signal`): every group's rewards are equal, so every advantage is zero: all-zero
  rewards (a broken reward, a task beyond the model) or a policy that samples one answer per prompt (entropy
  collapse).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class HealthConfig:
    """When a run that does not learn is reported, and whether it is stopped."""

    zero_grad_window: int = 3
    """Consecutive steps of zero gradients with non-zero advantages before the policy is reported dead."""
    no_signal_window: int = 10
    """Consecutive steps in which every group's rewards are equal before it is reported."""
    zero_grad_norm: float = 0.0
    """A minibatch gradient whose norm is at most this counts as zero."""
    stop: bool = False
    """Stop the run (exit code 1, no checkpoint) when a condition is reported, instead of only warning."""

    def __post_init__(self) -> None:
        for name in ("zero_grad_window", "no_signal_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"health.{name}={value!r} must be an integer >= 1")
        if not (isinstance(self.zero_grad_norm, (int, float)) and self.zero_grad_norm >= 0):
            raise ValueError(f"health.zero_grad_norm={self.zero_grad_norm!r} must be a number >= 0")


class HealthMonitor:
    """Follows the conditions step by step (identical on every rank: its inputs are global)."""

    def __init__(self, cfg: HealthConfig, lr: float | None = None):
        self.cfg = cfg
        self.lr = lr
        self.zero_grad_steps = 0
        self.no_signal_steps = 0
        self.failure: str | None = None
        """Set when a condition was reported with `health.stop`: the run must end with this message."""

    def observe(self, step: int, grad_norms: list[float], has_signal: bool, reward_mean: float) -> dict:
        """Metrics of this step; warns when a condition's window is full (with `health.stop`: sets `failure`).

        `grad_norms`: the step's minibatch gradient norms (NaN for a skipped step); `has_signal`: whether any
        rank's batch had a non-zero advantage."""
        finite = [g for g in grad_norms if math.isfinite(g)]
        zero_grad = bool(has_signal and finite and max(finite) <= self.cfg.zero_grad_norm)
        self.zero_grad_steps = self.zero_grad_steps + 1 if zero_grad else 0
        self.no_signal_steps = self.no_signal_steps + 1 if not has_signal else 0
        if self.zero_grad_steps == self.cfg.zero_grad_window:
            lr = f", optim.lr={self.lr:g}" if self.lr is not None else ""
            self._report(
                f"step {step}: the policy looks dead: zero gradient for {self.zero_grad_steps} steps although "
                f"advantages are non-zero (a collapsed model, e.g. a learning rate far too high{lr})"
            )
        if self.no_signal_steps == self.cfg.no_signal_window:
            self._report(
                f"step {step}: no learning signal for {self.no_signal_steps} steps: every group's rewards are equal "
                f"(reward_mean={reward_mean:.3f}): a reward that never pays, a task beyond the model, or a policy "
                "that samples one answer per prompt"
            )
        return {"health_zero_grad": float(zero_grad), "health_no_signal": float(not has_signal)}

    def state_dict(self) -> dict:
        """The open streaks, saved with the loop state: a resumed run continues its windows."""
        return {"zero_grad_steps": self.zero_grad_steps, "no_signal_steps": self.no_signal_steps}

    def load_state_dict(self, state: dict) -> None:
        self.zero_grad_steps = int(state.get("zero_grad_steps", 0))
        self.no_signal_steps = int(state.get("no_signal_steps", 0))

    def _report(self, message: str) -> None:
        if self.cfg.stop:
            self.failure = f"{message}; stopped (health.stop=true)"
            return
        log.warning("%s (metric health_*; health.stop=true stops such a run)", message)
