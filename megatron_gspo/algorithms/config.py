"""Configuration of the policy loss and of the rollout-mismatch correction, validated where values enter."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.algorithms.correction import CORRECTION_LEVELS, CORRECTION_MODES
from megatron_gspo.algorithms.grpo import GRPO_AGGREGATIONS, GRPO_CLIP_HIGH, GRPO_CLIP_LOW
from megatron_gspo.algorithms.gspo import GSPO_CLIP_HIGH, GSPO_CLIP_LOW

ALGORITHMS = ("gspo", "gspo_token", "grpo")
"""Policy losses `make_policy_loss` can build."""

PAPER_CLIP_RANGES: dict[str, tuple[float, float]] = {
    "gspo": (GSPO_CLIP_LOW, GSPO_CLIP_HIGH),
    "gspo_token": (GSPO_CLIP_LOW, GSPO_CLIP_HIGH),
    "grpo": (GRPO_CLIP_LOW, GRPO_CLIP_HIGH),
}
"""(eps_low, eps_high) the paper used for each algorithm (§5.1); GSPO-token shares GSPO's."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class PolicyLossConfig:
    """Which policy loss to optimise and its clip range (config section `loss`)."""

    algorithm: str = "gspo"
    """Which loss: "gspo" (Eq.5), "gspo_token" (Eq.14, per-token advantages) or "grpo" (Eq.2, baseline)."""
    clip_low: float | None = None
    """eps_low: the lower clip bound is 1 - clip_low; None = the paper's value (GSPO 3e-4, GRPO 0.2)."""
    clip_high: float | None = None
    """eps_high: the upper clip bound is 1 + clip_high; None = the paper's value (GSPO 4e-4, GRPO 0.27)."""
    grpo_aggregation: str = "seq-mean-token-mean"
    """GRPO only: "seq-mean-token-mean" (Eq.2) or "token-mean" (every token weighs the same)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"loss.algorithm={self.algorithm!r} is unknown; choose gspo, gspo_token or grpo")
        if self.clip_low is not None and not (_is_number(self.clip_low) and 0.0 <= self.clip_low < 1.0):
            raise ValueError(
                f"loss.clip_low={self.clip_low!r} must be a number in [0, 1) (lower bound 1 - clip_low), "
                "or null for the paper's value"
            )
        if self.clip_high is not None and not (_is_number(self.clip_high) and self.clip_high >= 0.0):
            raise ValueError(
                f"loss.clip_high={self.clip_high!r} must be a number >= 0 (upper bound 1 + clip_high), "
                "or null for the paper's value"
            )
        if self.grpo_aggregation not in GRPO_AGGREGATIONS:
            raise ValueError(
                f"loss.grpo_aggregation={self.grpo_aggregation!r} is unknown; "
                "choose seq-mean-token-mean or token-mean"
            )

    @property
    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high) with None replaced by the algorithm's paper default."""
        default_low, default_high = PAPER_CLIP_RANGES[self.algorithm]
        low = default_low if self.clip_low is None else float(self.clip_low)
        high = default_high if self.clip_high is None else float(self.clip_high)
        return low, high


@dataclass
class RolloutCorrectionConfig:
    """Importance correction for rollouts sampled by another engine (config section `rollout_correction`)."""

    level: str = "off"
    """Per "token", per "sequence" (exp of the mean token log-ratio), or "off" (monitor the mismatch only)."""
    mode: str = "truncate"
    """Weights above `threshold` are cut to it ("truncate") or set to 0 ("mask")."""
    threshold: float = 2.0
    """Largest weight kept as is (>= 1)."""

    def __post_init__(self) -> None:
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(
                f"rollout_correction.level={self.level!r} is unknown; choose off, token or sequence"
            )
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"rollout_correction.mode={self.mode!r} is unknown; choose truncate or mask")
        if not (_is_number(self.threshold) and self.threshold >= 1.0):
            raise ValueError(
                f"rollout_correction.threshold={self.threshold!r} must be a number >= 1 "
                "(weights above it are truncated or masked)"
            )
