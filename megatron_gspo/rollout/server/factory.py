"""Building a server engine on every trainer rank: global rank 0 leads (launches / checks the servers, pushes
weights), the other ranks attach to the URLs it shares; each model replica generates through one rank."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

from megatron_gspo.rollout.server.buckets import NamedTensor
from megatron_gspo.rollout.server.config import ServerConfig
from megatron_gspo.rollout.server.engine import Exporter, ServerEngine
from megatron_gspo.rollout.server.replicas import replica_group


def default_exporter(runtime: Any, many: bool) -> Exporter:
    """The foundation's streaming HF export (tensors gathered to global rank 0 only when there are several)."""
    from megatron_gspo.models.hf_state import iter_hf_tensors

    dst, dtype = (0 if many else None), runtime.dtype

    def export(chunks: list) -> Iterable[NamedTensor]:
        return iter_hf_tensors(chunks, dst=dst, dtype=dtype)

    return export


def make_server_engine(
    engine_cls: type[ServerEngine],
    cfg: ServerConfig,
    runtime: Any,
    *,
    exporter: Exporter | None = None,
    **engine_kwargs: Any,
) -> ServerEngine:
    """The engine of a training run, on every trainer rank (a collective when there are several ranks).

    `runtime` provides `dtype` (of the exported weights). A failure on rank 0 is reported on every rank instead of
    hanging them. `engine_kwargs` go to every rank's engine. `engine_cls.follower_config(cfg, server_urls, generate_urls)` makes the attach-mode config of
    the other ranks.
    """
    import torch.distributed as dist

    many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if exporter is None:
        exporter = default_exporter(runtime, many)
    if not many:
        return engine_cls(cfg, exporter, **engine_kwargs)
    replica = replica_group()
    shared: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            engine = engine_cls(cfg, exporter, barrier=all_ranks_ok, replica=replica, **engine_kwargs)
        except BaseException as e:
            dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
            raise
        shared = [(reachable(engine.server_urls), reachable(engine.generate_urls))]
        dist.broadcast_object_list(shared, src=0)
        return engine
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], str):
        raise RuntimeError(f"rank 0 could not start the {engine_cls.kind} engine: {shared[0]}")
    server_urls, generate_urls = shared[0]
    follower = engine_cls.follower_config(cfg, server_urls, generate_urls)
    return engine_cls(
        follower, exporter, leader=False, barrier=all_ranks_ok, replica=replica, **engine_kwargs
    )


def all_ranks_ok(ok: bool = True) -> bool:
    """A barrier of every trainer rank that also says whether every rank reached it `ok` (the end of a weight
    sync: followers take the new version only when the leader's push succeeded)."""
    import torch.distributed as dist

    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    return all(flags)


def reachable(urls: list[str]) -> list[str]:
    """URLs other nodes can use: a wildcard bind address becomes this host's name."""
    return [u.replace("://0.0.0.0:", f"://{socket.gethostname()}:") for u in urls]
