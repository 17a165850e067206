"""Configuration of the policy loss and of the rollout-mismatch correction, validated where values enter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_gspo.algorithms.correction import CORRECTION_LEVELS, CORRECTION_MODES, SEQUENCE_WEIGHTS
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
    mask_truncated: bool = False
    """Responses cut at rollout.max_new_tokens (finish_reason 'length') contribute no gradient: their advantage
    is 0 (DAPO's overlong filtering); they still count in the batch size, as zero-variance groups do."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment, L_cache (0 = off): with L_max = rollout.max_new_tokens (multi-turn:
    multiturn.max_total_tokens; L counts the model's tokens only, never the environment's) a response of
    length L gets (L_max - L_cache - L) / L_cache * overlong_penalty_factor added to its reward when
    L > L_max - L_cache (down to -factor at L_max), 0 otherwise."""
    overlong_penalty_factor: float = 1.0
    """Scale of the overlong penalty (DAPO: 1)."""

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
        if isinstance(self.overlong_buffer, bool) or not isinstance(self.overlong_buffer, int) or (
            self.overlong_buffer < 0
        ):
            raise ValueError(f"loss.overlong_buffer={self.overlong_buffer!r} must be an integer >= 0 (0 = off)")
        if not (_is_number(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0):
            raise ValueError(f"loss.overlong_penalty_factor={self.overlong_penalty_factor!r} must be a number >= 0")
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


CORRECTION_PRESETS: dict[str, dict] = {
    "monitor": {},
    "gspo_seq_tis": {"level": "sequence", "mode": "truncate", "threshold": 2.0},
    "gspo_seq_mis": {"level": "sequence", "mode": "mask", "threshold": 2.0},
    "gspo_geo_band": {"level": "off", "geo_mask_low": 0.99, "geo_mask_high": 1.01},
    "gspo_decoupled": {"level": "sequence", "mode": "mask", "threshold": 5.0},
    "grpo_token_tis": {"level": "token", "mode": "truncate", "threshold": 2.0},
    "grpo_token_mis": {"level": "token", "mode": "mask", "threshold": 2.0},
    "grpo_icepop": {"level": "token", "mode": "mask", "threshold": 2.0, "mask_below": 0.5},
    "grpo_decoupled": {"level": "token", "mode": "mask", "threshold": 5.0},
}
"""Named corrections (`rollout.correction.preset`), each needing rollout.old_logprobs=recompute (pi_prox = the
trainer's recomputed log-probs, pi_behav = the engine's):
- monitor: no weight; the mismatch is logged (the default behaviour).
- gspo_seq_tis / gspo_seq_mis: the length-normalised sequence weight exp(mean_t log pi_prox/pi_behav), truncated
  at / masked above 2 (GSPO's own form of the correction, §5.4).
- gspo_geo_band: SkyRL's recommendation for MoE with R3: keep a sequence only when exp(mean) is in [0.99, 1.01].
- gspo_decoupled / grpo_decoupled: AReaL's decoupled PPO objective, importance weight pi_prox/pi_behav (sequence
  form for GSPO, per token for GRPO / GSPO-token) times the clipped ratio pi_theta/pi_prox, masked above 5.
- grpo_token_tis / grpo_token_mis: per-token truncated / masked importance sampling, C = 2.
- grpo_icepop: icepop's two-sided token mask, tokens whose ratio leaves [1/2, 2] are dropped.
Token-level presets need a token-level loss (grpo, gspo_token)."""


_DEFAULTS: dict[str, Any] = {"level": "off", "mode": "truncate", "threshold": 2.0, "sequence_weight": "geometric"}
"""RolloutCorrectionConfig's values for keys neither set nor given by the preset."""


@dataclass
class RolloutCorrectionConfig:
    """Importance correction between the trainer's and the rollout engine's log-probs (config section
    `rollout.correction`); `resolved()` is what the trainer applies."""

    preset: str | None = None
    """A named correction (CORRECTION_PRESETS); every key set here (even to its usual default) overrides it. Keys
    left null take the preset's value, else their default (_DEFAULTS); `__post_init__` fills them in."""
    level: str | None = None
    """Per "token", per "sequence" (exp of the mean token log-ratio), or "off" (monitor the mismatch only)."""
    mode: str | None = None
    """Weights above `threshold` are cut to it ("truncate", TIS) or set to 0 ("mask", MIS)."""
    threshold: float | None = None
    """Largest weight kept as is (>= 1)."""
    mask_below: float | None = None
    """Weights below this are set to 0 too (two-sided mask; icepop: 1 / threshold at token level); null = off."""
    sequence_weight: str | None = None
    """level=sequence: "geometric" exp(mean_t d) (length-normalised) or "product" exp(sum_t d) (unbiased; tiny
    or huge on long answers). Both are logged whatever is chosen."""
    geo_mask_low: float | None = None
    """Geometric mask band: a sequence whose exp(mean_t d) is below this contributes nothing (null = no bound)."""
    geo_mask_high: float | None = None
    """Geometric mask band: a sequence whose exp(mean_t d) is above this contributes nothing (null = no bound)."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in CORRECTION_PRESETS:
            raise ValueError(
                f"rollout.correction.preset={self.preset!r} is unknown; choose one of {', '.join(CORRECTION_PRESETS)}"
            )
        # Unset (null) keys are filled here, so that a key written to its usual default still overrides the
        # preset (preset=gspo_seq_mis, mode=truncate) and the dumped config reloads to the same correction.
        # The null-default bounds (mask_below, geo_mask_*) cannot be unset against a preset that sets them.
        preset = CORRECTION_PRESETS[self.preset] if self.preset is not None else {}
        for name in ("level", "mode", "threshold", "sequence_weight", "mask_below", "geo_mask_low", "geo_mask_high"):
            if getattr(self, name) is None:
                setattr(self, name, preset.get(name, _DEFAULTS.get(name)))
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(
                f"rollout.correction.level={self.level!r} is unknown; choose off, token or sequence"
            )
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"rollout.correction.mode={self.mode!r} is unknown; choose truncate or mask")
        if not (_is_number(self.threshold) and self.threshold >= 1.0):
            raise ValueError(
                f"rollout.correction.threshold={self.threshold!r} must be a number >= 1 "
                "(weights above it are truncated or masked)"
            )
        if self.mask_below is not None and not (_is_number(self.mask_below) and 0.0 <= self.mask_below <= 1.0):
            raise ValueError(
                f"rollout.correction.mask_below={self.mask_below!r} must be a number in [0, 1] or null (off)"
            )
        if self.sequence_weight not in SEQUENCE_WEIGHTS:
            raise ValueError(
                f"rollout.correction.sequence_weight={self.sequence_weight!r} is unknown; choose geometric or product"
            )
        for name, bound in (("geo_mask_low", self.geo_mask_low), ("geo_mask_high", self.geo_mask_high)):
            if bound is not None and not (_is_number(bound) and bound > 0):
                raise ValueError(f"rollout.correction.{name}={bound!r} must be a number > 0 or null (no bound)")
        if self.geo_mask_low is not None and self.geo_mask_low > 1.0:
            raise ValueError(
                f"rollout.correction.geo_mask_low={self.geo_mask_low} must be <= 1 (it would drop every sequence "
                "without a mismatch)"
            )
        if self.geo_mask_high is not None and self.geo_mask_high < 1.0:
            raise ValueError(
                f"rollout.correction.geo_mask_high={self.geo_mask_high} must be >= 1 (it would drop every sequence "
                "without a mismatch)"
            )

    def resolved(self) -> RolloutCorrectionConfig:
        """The correction to apply: this config (`__post_init__` already applied the preset under the keys set)."""
        return self

    @property
    def active(self) -> bool:
        """Whether anything changes the loss (a weight or a mask band), as opposed to logging the mismatch only."""
        return self.level != "off" or self.geo_mask_low is not None or self.geo_mask_high is not None
