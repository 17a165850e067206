"""The `multiturn.*` keys of a run config: which environment a trajectory talks to, and its limits."""

from __future__ import annotations

from dataclasses import dataclass

ADVANTAGES = ("trajectory", "turn_return")
"""What `multiturn.advantage` may be."""


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts: model turn -> environment / tool -> model turn ... (rollout/multiturn/driver.py)."""

    env: str | None = None
    """Environment of every trajectory: a registered name (rollout/multiturn/registry.py: 'calculator') or
    `module:factory` returning a gymnasium.Env with text actions and observations; None: single-turn rollouts."""
    max_turns: int = 4
    """Most model turns per trajectory; a trajectory still going after them is truncated (finish_reason 'length')."""
    max_total_tokens: int = 64
    """Most response tokens per trajectory, the model's and the environment's together (each turn's generation is
    capped by what is left; an observation that does not fit truncates the trajectory)."""
    env_timeout_s: float = 10.0
    """Longest an environment call (reset / step) may take; a slower one fails its sample (never the run)."""
    advantage: str = "trajectory"
    """'trajectory': one advantage per trajectory (Eq.6 of the environment's total reward); 'turn_return': each
    model token gets its turn's advantage, the group-normalised return from that turn on (rollout/multiturn/
    turn_advantages.py), for loss.algorithm=gspo_token (the paper's per-token A_i,t, Eq.13-14) or grpo."""

    def __post_init__(self) -> None:
        if self.env is not None and (not isinstance(self.env, str) or not self.env):
            raise ValueError(f"multiturn.env={self.env!r} must be a registered name, 'module:factory' or null")
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"multiturn.max_turns={self.max_turns!r} must be an integer >= 1")
        if not isinstance(self.max_total_tokens, int) or self.max_total_tokens < 2:
            raise ValueError(f"multiturn.max_total_tokens={self.max_total_tokens!r} must be an integer >= 2")
        if not self.env_timeout_s > 0:
            raise ValueError(f"multiturn.env_timeout_s={self.env_timeout_s!r} must be > 0")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"multiturn.advantage={self.advantage!r} must be one of {', '.join(ADVANTAGES)}")
        if self.advantage != "trajectory" and self.env is None:  # single-turn rollouts have no turns to credit
            raise ValueError(f"multiturn.advantage={self.advantage} needs multi-turn rollouts; set multiturn.env or "
                             "multiturn.advantage=trajectory")

    @property
    def enabled(self) -> bool:
        return self.env is not None
