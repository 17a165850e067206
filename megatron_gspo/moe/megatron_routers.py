"""The one boundary to megatron-core's RouterReplay (0.16) and the parallel state routing replay needs.

megatron-core keeps every router's `RouterReplay` in a class-level list (`global_router_replay_instances`, in
construction order) and steers them through static methods; the router asks its instance for the top-k:
RECORD computes and keeps it, REPLAY_FORWARD uses the last `set_replay_data` target, REPLAY_BACKWARD pops the
oldest target of a FIFO that every `set_replay_data` call appends to (for activation recompute, where the
backward pass re-runs the router once per micro-batch, in forward order). megatron never switches to
REPLAY_BACKWARD itself: the caller must (see `in_recompute`). Replay is silently skipped when
`moe_router_fusion=True` (the fused top-k never consults RouterReplay), so that combination is refused here.
Replay gathers the router scores at the replayed ids, so the router weight still gets gradients; the
auxiliary load-balancing loss is computed from the router's own top-k, not the replayed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

ACTIONS = {
    "record": RouterReplayAction.RECORD,
    "replay_forward": RouterReplayAction.REPLAY_FORWARD,
    "replay_backward": RouterReplayAction.REPLAY_BACKWARD,
}


@dataclass(frozen=True)
class RankPlacement:
    """Where this rank's routers sit: their global layers and the slice of the sequence they see."""

    layer_ids: tuple[int, ...]
    """Global (0-based) layer index of each local router, in construction order."""
    token_split: int
    """Ways the sequence dimension is split before the router (TP size under sequence parallel, else 1)."""
    split_rank: int
    """This rank's slice of that split (its TP rank)."""
    device: torch.device
    """Where the routers compute (replay targets are built there)."""


def _unwrap(chunk):
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def in_recompute() -> bool:
    """True while megatron's activation checkpointing re-runs a forward inside the backward pass.

    `tensor_parallel.checkpoint` (full recompute, and the selective 'moe' module recompute) flags itself as
    checkpointing both when it first runs the wrapped forward - under `torch.no_grad()` - and when it re-runs it
    in the backward pass - under `torch.enable_grad()`. So "checkpointing with grad enabled" is the recompute.
    """
    return is_checkpointing() and torch.is_grad_enabled()


class ReplayRouters:
    """This rank's replay-enabled routers (one per local MoE layer, construction order) and their RouterReplay
    instances, driven through megatron's static API."""

    def __init__(self, model_chunks, mode: str = "r2"):
        what = "recording MoE routes (moe.drift_every)" if mode == "off" else f"moe.routing_replay={mode}"
        chunks = [_unwrap(c) for c in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks])]
        if len(chunks) != 1:
            raise ValueError(
                f"{what} supports one model chunk per rank; parallel.virtual_pp (interleaved "
                f"pipeline, {len(chunks)} chunks) is not supported with routing replay"
            )
        modules, layer_ids = [], []
        for chunk in chunks:
            for layer in getattr(chunk.decoder, "layers", []):
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if router is None:
                    continue
                modules.append(router)
                layer_ids.append(int(layer.layer_number) - 1)
        if not modules:
            raise ValueError("the model has no MoE routers on this rank; routing replay needs MoE layers")
        config = modules[0].config
        if not getattr(config, "moe_enable_routing_replay", False) or any(r.router_replay is None for r in modules):
            raise ValueError(
                f"{what} needs routers built with megatron's RouterReplay: build the model with "
                "BuildOptions(routing_replay=True) (TransformerConfig.moe_enable_routing_replay)"
            )
        if config.moe_router_fusion:
            raise ValueError(
                f"{what} cannot be used with moe_router_fusion=True: megatron-core skips replay "
                "in the fused router; disable router fusion"
            )
        if (getattr(config, "fp8", None) or getattr(config, "fp4", None)) and config.recompute_granularity is not None:
            raise ValueError(
                f"{what} with fp8/fp4 activation recompute is not supported: megatron recomputes "
                "through transformer-engine's checkpoint there, which routing replay cannot tell from a forward; "
                "turn off model.recompute or fp8/fp4"
            )
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError(
                f"{what} with parallel.cp={config.context_parallel_size} is not supported "
                "(context parallelism reorders tokens before the router); use parallel.cp=1"
            )
        instances = [r.router_replay for r in modules]
        registered = RouterReplay.global_router_replay_instances
        if not registered:
            raise ValueError(
                "megatron's RouterReplay registry is empty: it was released (RoutingReplay.close()) after this "
                "model was built; build the model again to replay its routing"
            )
        if len(registered) != len(instances) or any(a is not b for a, b in zip(registered, instances)):
            raise ValueError(
                f"megatron's RouterReplay registry holds {len(registered)} routers but this model has "
                f"{len(instances)} on this rank: another replay-enabled model was built in this process. megatron "
                "steers all registered routers together; close the other model's RoutingReplay (or call "
                "release_router_replay_registry()) before building this one"
            )
        self.modules: list[torch.nn.Module] = modules
        self.config = config
        self.num_experts = int(config.num_moe_experts)
        self.topk = int(config.moe_router_topk)
        sp = bool(config.sequence_parallel)
        tp = ps.get_tensor_model_parallel_world_size()
        # Replay targets go where the routers' weights are (the model's device).
        device = modules[0].weight.device
        self.placement = RankPlacement(
            layer_ids=tuple(layer_ids),
            token_split=tp if sp else 1,
            split_rank=ps.get_tensor_model_parallel_rank() if sp else 0,
            device=device,
        )

    # ---- megatron static API -----------------------------------------------------------------------------
    def set_action(self, action: str | None) -> None:
        """Sets every registered router's action ("record" | "replay_forward" | "replay_backward"), or clears it
        (None: route normally)."""
        if action is None:
            RouterReplay.clear_global_router_replay_action()
        else:
            RouterReplay.set_global_router_replay_action(ACTIONS[action])

    def set_replay_data(self, per_layer: list[torch.Tensor]) -> None:
        """Targets of the next forward, one int64 [local tokens, K] per local layer (appended to the recompute
        FIFO too)."""
        RouterReplay.set_replay_data(per_layer)

    def recorded(self, layer: int) -> torch.Tensor | None:
        """The top-k ids local layer `layer` recorded in its last RECORD call."""
        return RouterReplay.get_recorded_data()[layer]

    def clear(self) -> None:
        """Drops recorded ids, targets and the recompute FIFO of every router, and clears their actions."""
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()

    def release(self) -> None:
        """Empties megatron's registry (so another replay-enabled model can be built and steered)."""
        self.clear()
        release_router_replay_registry()

    # ---- process groups ----------------------------------------------------------------------------------
    @staticmethod
    def tp_group():
        return ps.get_tensor_model_parallel_group()

    @staticmethod
    def pp_group():
        return ps.get_pipeline_model_parallel_group()

    @staticmethod
    def pp_size() -> int:
        return ps.get_pipeline_model_parallel_world_size()


def release_router_replay_registry() -> None:
    """Clears megatron's global list of RouterReplay instances (routers built afterwards register afresh)."""
    RouterReplay.clear_global_router_replay_instances()
