"""One source of rollouts per model replica: the TP x PP ranks that train one forward must see the same samples.

Servers are not batch-invariant, so two ranks sending the same requests can get different tokens back; if the
tensor- or pipeline-parallel peers of one replica generated on their own they would train one forward on
different tokens, lengths and rewards (silent garbage gradients). So one rank of each model-parallel group
generates and broadcasts the rollouts to its group, as the local engine's HF backend does; data-parallel replicas
generate their own prompts, with seeds that include the data-parallel rank (server/seeds.py).

megatron-core keeps its process groups in globals: they are read here, in `replica_group`, and nowhere else in
the server engines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaGroup:
    """This rank's model replica and which of its ranks talks to the servers."""

    group: Any
    """Process group of the replica's ranks (megatron's model-parallel group); None when the rank is alone."""
    source: int
    """Global rank that generates for the replica (the group's first rank)."""
    rank: int
    """This process's global rank."""
    size: int
    """Ranks in the replica."""
    dp_rank: int
    """The replica's data-parallel rank (mixed into request seeds)."""

    @property
    def is_source(self) -> bool:
        """Whether this rank generates (and the others receive)."""
        return self.rank == self.source

    def share(self, generate: Callable[[], T]) -> T:
        """`generate()` on the source rank, its result broadcast to the replica; a collective of the group.

        A failure on the source reaches every rank (the source re-raises its own error, the others a one-line
        RuntimeError naming it) instead of leaving them waiting at the next collective.
        """
        if self.size == 1:
            return generate()
        payload: list[Any] = [None]
        error: BaseException | None = None
        if self.is_source:
            try:
                payload[0] = ("ok", generate())
            except Exception as e:  # noqa: BLE001 - the peers must learn about it instead of waiting forever
                error = e
                payload[0] = ("error", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(payload, src=self.source, group=self.group)
        status, value = payload[0]
        if error is not None:
            raise error
        if status != "ok":
            raise RuntimeError(f"rollout generation failed on rank {self.source}: {value}")
        return value


def replica_group() -> ReplicaGroup | None:
    """This rank's replica from megatron-core's model-parallel group; None without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    if not ps.model_parallel_is_initialized():
        return ReplicaGroup(group=None, source=rank, rank=rank, size=1, dp_rank=rank)
    group = ps.get_model_parallel_group()
    size = dist.get_world_size(group)
    return ReplicaGroup(
        group=group,
        source=dist.get_global_rank(group, 0),
        rank=rank,
        size=size,
        dp_rank=ps.get_data_parallel_rank(),
    )
