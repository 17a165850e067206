"""Where rollout production meets training consumption (DESIGN.md "The loop as stages").

The rollout stage puts scored groups (one prompt, its G rollouts and their rewards) into the buffer, each with the
weight version that sampled it: the version every engine reports per rollout (`Rollout.weight_version`: the RL
step whose weights the engine held; the trainer syncs the engine after every step, so a group produced before step
s's update carries version s), the oldest of its rollouts' (`group_version`). The training stage takes one rollout
batch's worth of groups out.

Synchronous RL (today's loop) is this buffer with no look-ahead: the rollout stage fills it right before the
training stage empties it, so every group has staleness 0 (the engine was synced after the last update) and nothing
is left over between steps (what the step does not use is dropped and counted); no staleness bound is needed
(`max_staleness=None`). Asynchronous RL adds a producer that runs ahead within `max_staleness` versions; groups
older than that are dropped, counted, when they are taken.

Which groups a rollout batch gets: groups with learning signal (reward variance within the group, GSPO Eq. 6
advantages not all zero) first, in the order they were produced; then, up to the batch size, zero-variance groups
in their order (zero advantage: no gradient, but every data-parallel rank needs the same number of sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_gspo.data.types import PromptItem
from megatron_gspo.rollout.types import Rollout


def group_version(rollouts: list[Rollout]) -> int:
    """The weight version of a group: the oldest its rollouts were sampled under (a partial rollout continued after
    a weight update reports the version of its oldest tokens)."""
    if not rollouts:
        raise ValueError("a rollout group needs at least one rollout")
    return min(int(r.weight_version) for r in rollouts)


@dataclass(eq=False)
class RolloutGroup:
    """One prompt's G rollouts, scored, with the weight version that sampled them."""

    item: PromptItem
    rollouts: list[Rollout]
    rewards_G: torch.Tensor
    weight_version: int
    """RL steps whose update the sampling weights included (0: the initial policy)."""

    @property
    def informative(self) -> bool:
        """Whether the group's rewards vary (its advantages are not all zero)."""
        return bool(self.rewards_G.max() > self.rewards_G.min())


@dataclass
class Taken:
    """The groups of one rollout batch and what the buffer left out for it."""

    groups: list[RolloutGroup]
    zero_variance_kept: int
    """Zero-variance groups in `groups` (filling up to the batch size)."""
    dropped: int
    """Zero-variance groups not needed for the batch, dropped."""
    stale: int
    """Groups dropped for being more than `max_staleness` versions old."""
    staleness: list[int] = field(default_factory=list)
    """Versions each taken group lags the consuming weights by, in `groups` order."""


class RolloutBuffer:
    """Scored rollout groups between the rollout stage and the training stage of the RL loop (module doc)."""

    def __init__(self, max_staleness: int | None = None):
        if max_staleness is not None and (
            not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0
        ):
            raise ValueError(f"max_staleness={max_staleness!r} must be an integer >= 0 or None (no bound)")
        self.max_staleness = max_staleness
        self._informative: list[RolloutGroup] = []
        self._flat: list[RolloutGroup] = []

    def __len__(self) -> int:
        return len(self._informative) + len(self._flat)

    def put(self, groups: list[RolloutGroup]) -> None:
        """Adds scored groups (kept in production order within each kind)."""
        for g in groups:
            (self._informative if g.informative else self._flat).append(g)

    def ready(self, want: int, version: int) -> bool:
        """Whether `take(want, version)` would find a full batch."""
        return sum(self._fresh(g, version) for g in (*self._informative, *self._flat)) >= want

    def _fresh(self, group: RolloutGroup, version: int) -> bool:
        return self.max_staleness is None or version - group.weight_version <= self.max_staleness

    def take(self, want: int, version: int) -> Taken:
        """The groups of one rollout batch for weights of `version`: up to `want` informative groups, then
        zero-variance ones up to exactly `want` (every data-parallel rank must hold as many sequences: a short
        batch would leave the ranks' collectives unmatched, so it is a RuntimeError, never a smaller batch).
        Zero-variance groups left over are dropped (they carry no signal; a later batch is better served by fresh
        ones); informative groups left over stay for the next batch."""
        if want < 0:
            raise ValueError(f"want={want} must be >= 0")
        if not self.ready(want, version):
            raise RuntimeError(
                f"the rollout buffer holds {len(self)} groups, fewer than the {want} a rollout batch needs within "
                f"max_staleness={self.max_staleness} of weight version {version}"
            )
        stale = 0
        for pool in (self._informative, self._flat):
            fresh = [g for g in pool if self._fresh(g, version)]
            stale += len(pool) - len(fresh)
            pool[:] = fresh
        chosen, self._informative = self._informative[:want], self._informative[want:]
        fill = want - len(chosen)
        kept, dropped = self._flat[:fill], len(self._flat) - min(fill, len(self._flat))
        self._flat = []
        groups = chosen + kept
        return Taken(
            groups=groups,
            zero_variance_kept=len(kept),
            dropped=dropped,
            stale=stale,
            staleness=[version - g.weight_version for g in groups],
        )
