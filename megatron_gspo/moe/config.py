"""MoE options of a run (config section `moe`): routing replay (R2 / R3) and expert-drift measurement."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

ROUTING_REPLAY_MODES = ("off", "r2", "r3")
"""off: no replay; r2: replay the old-policy pass's routing in training (GSPO paper §5.3);
r3: replay the rollout engine's routing in the old-policy pass and in training (arXiv:2510.11370)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class MoEConfig:
    """Routing replay and stability measurement for MoE layers."""

    routing_replay: str = "off"
    """off | r2 (record top-k experts in the old-policy log-prob pass, replay them in every training forward of
    that rollout batch) | r3 (replay the rollout engine's routing in the old-policy pass and in training)."""
    drift_every: int = 1
    """Measure expert drift (top-k sets of the same batch before / after an optimizer step) every N steps; 0
    disables it. Without replay the other steps record no routes and run no extra forward, so the rollout engine /
    trainer routing mismatch (from the same recording) is reported on drift steps only; R2 records, and reports
    the mismatch, every step."""
    drift_sample_sequences: int = 0
    """Sequences used for the drift measurement; 0 = the whole drift minibatch (the second with free routing and
    K >= 2 minibatches, measured in its own training forward; else the first, with one extra forward)."""
    drift_rollout: bool = False
    """Also measure the drift accumulated over the rollout batch (pi_old vs the policy after all K optimizer steps,
    `expert_drift_rollout*`) on drift steps: one more forward of the drift sample per such step, so it is opt-in;
    the stability benchmark turns it on."""

    def __post_init__(self) -> None:
        if self.routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"moe.routing_replay={self.routing_replay!r} is unknown; choose off, r2 or r3")
        if not _is_int(self.drift_every) or self.drift_every < 0:
            raise ValueError(f"moe.drift_every={self.drift_every!r} must be an integer >= 0 (0 disables drift)")
        if not isinstance(self.drift_rollout, bool):
            raise ValueError(f"moe.drift_rollout={self.drift_rollout!r} must be true or false")
        if not _is_int(self.drift_sample_sequences) or self.drift_sample_sequences < 0:
            raise ValueError(
                f"moe.drift_sample_sequences={self.drift_sample_sequences!r} must be an integer >= 0 "
                "(0 = the whole drift minibatch)"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> MoEConfig:
        """From the `moe:` section of a run config; unknown keys raise a ValueError naming them."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"moe.{unknown[0]} is not a known option; choose from {sorted(known)}")
        return cls(**data)

    @property
    def replays(self) -> bool:
        """Whether training forwards replay recorded routes (r2 or r3)."""
        return self.routing_replay != "off"

    @property
    def needs_router_replay(self) -> bool:
        """Whether the model must be built with megatron's RouterReplay (`BuildOptions(routing_replay=True)`):
        replay needs it, and so does recording routes for the drift measurement."""
        return self.replays or self.drift_every > 0

    def measure_drift(self, step: int) -> bool:
        """Whether expert drift is measured at optimizer step `step` (0-based)."""
        return self.drift_every > 0 and step % self.drift_every == 0
