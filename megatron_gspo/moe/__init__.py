"""MoE routing replay (R2 / R3) on megatron-core's RouterReplay, and MoE stability metrics (expert drift,
routing mismatch, train / inference log-prob mismatch).

`config`, `routes` and `stability` are plain PyTorch; `RoutingReplay` (which imports megatron-core) is loaded on
first use.
"""

from megatron_gspo.moe.config import ROUTING_REPLAY_MODES, MoEConfig
from megatron_gspo.moe.routes import RouteStore, TokenLayout, pad_expert_ids
from megatron_gspo.moe.stability import (
    expert_drift,
    logprob_mismatch,
    record_routes,
    response_token_mask,
    route_change,
    routing_mismatch,
    store_route_change,
    topk_overlap,
)

_LAZY = {"RoutingReplay", "Recording", "route_metrics", "gather_layers"}


def __getattr__(name: str):
    if name in _LAZY:
        from megatron_gspo.moe import routing_replay

        return getattr(routing_replay, name)
    raise AttributeError(f"module 'megatron_gspo.moe' has no attribute {name!r}")


__all__ = [
    "ROUTING_REPLAY_MODES",
    "MoEConfig",
    "Recording",
    "RouteStore",
    "RoutingReplay",
    "TokenLayout",
    "expert_drift",
    "gather_layers",
    "logprob_mismatch",
    "pad_expert_ids",
    "record_routes",
    "response_token_mask",
    "route_change",
    "route_metrics",
    "routing_mismatch",
    "store_route_change",
    "topk_overlap",
]
