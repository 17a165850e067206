"""Routing Replay (GSPO paper §5.3) on megatron-core 0.16's RouterReplay, without patching the router.

- R2: the old-policy log-prob pass records each MoE layer's top-k expert ids per token (`record()`); every
  training forward of that rollout batch, all minibatches, replays them (`replay(routes)`).
- R3 (arXiv:2510.11370): the rollout engine's routing (`RouteStore.from_rollouts`) is replayed in the
  old-policy pass and in training (`replay(routes)` around both).

How the trainer drives it (one `RoutingReplay` per model, built with `BuildOptions(routing_replay=True)`):

    rr = RoutingReplay(model_chunks, mode="r2")

    def forward_step(batch, model):          # called by megatron's schedule, once per micro-batch and stage
        rr.set_microbatch(batch.seq_indices, batch.layout)    # BEFORE the model forward; no-op outside contexts
        return model(...), loss_func

    with rr.record() as rec:                  # R2 old-policy pass (forward only)
        forward_backward(chunks, micro_batches, forward_step, forward_only=True, ...)
    routes = rec.routes                       # RouteStore: this stage's layers, full sequences (TP-gathered)
    for minibatch in minibatches:
        with rr.replay(routes):               # one context per forward_backward call
            forward_backward(chunks, minibatch_micro_batches, forward_step, ...)
        optimizer.step()

Per micro-batch timing: megatron's schedules call `forward_step` right before that micro-batch's forward on
this stage (1F1B interleaves backward passes of earlier micro-batches between them), so `set_microbatch`
there is always "the next forward". Each router gets a forward pre-hook that picks the action per call:
RECORD / REPLAY_FORWARD for the forward, and for a re-run inside the backward pass (activation recompute,
`megatron_routers.in_recompute`) REPLAY_BACKWARD, which pops megatron's per-router FIFO that `set_replay_data`
fills once per micro-batch in forward order - exactly the order backward passes run in (no pipelining and
1F1B alike). During `record()` a recompute routes normally and is not recorded. A forward hook harvests the
recorded ids after each forward (RECORD overwrites them on every call), in the compact dtype.

Recorded ids are per rank: this stage's layers, this TP rank's slice of the sequence (sequence parallel).
Leaving `record()` all-gathers the slices over TP (a collective: every TP rank leaves it together) and turns
each micro-batch's [S, B] grid back into per-sequence routes, so a later replay may use any other micro-batch
split or layout (padded or packed). Pipeline stages keep only their own layers (replay on a stage needs only
those); `gather_pipeline_layers` assembles all layers for metrics or export.

Not supported (refused with a clear error): router fusion (megatron skips replay there), interleaved pipeline
(virtual_pp; the FIFO is per router but megatron's set_replay_data feeds all chunks), context parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_gspo.moe.megatron_routers import ReplayRouters, in_recompute
from megatron_gspo.moe.routes import RouteStore, TokenLayout, gather_from_grid
from megatron_gspo.rollout.types import compact_expert_dtype

_OFF, _RECORD, _REPLAY = "off", "record", "replay"


@dataclass
class Recording:
    """What `RoutingReplay.record()` yields; `routes` is filled when the context exits."""

    routes: RouteStore | None = None


@dataclass
class _PendingMicroBatch:
    seq_indices: tuple[int, ...]
    layout: TokenLayout
    layers: list = field(default_factory=list)
    """Per local layer: recorded compact ids [local tokens, K] (None until the layer ran)."""


class RoutingReplay:
    """Records and replays MoE routing of one model (this rank's chunk) through megatron's RouterReplay."""

    def __init__(self, model_chunks, num_experts: int | None = None, *, mode: str = "r2", store_device="cpu"):
        """`model_chunks`: this rank's (DDP-wrapped or bare) GPTModel chunks built with
        `BuildOptions(routing_replay=True)`. `num_experts` is checked against the model when given. `mode` names
        the setting in error messages. Recorded routes are kept on `store_device` (CPU by default)."""
        if mode not in ("r2", "r3", "off"):
            raise ValueError(f"moe.routing_replay={mode!r} is unknown; choose off, r2 or r3")
        self.mode = mode
        self._routers = ReplayRouters(model_chunks, mode)
        if num_experts is not None and int(num_experts) != self._routers.num_experts:
            raise ValueError(f"num_experts={num_experts} but the model's routers have {self._routers.num_experts}")
        self.num_experts = self._routers.num_experts
        self.topk = self._routers.topk
        self.placement = self._routers.placement
        self.layer_ids = self.placement.layer_ids
        self.store_device = torch.device(store_device)
        self._phase = _OFF
        self._action: str | None = None
        self._store: RouteStore | None = None
        self._targets: list[torch.Tensor] | None = None
        self._pending: list[_PendingMicroBatch] = []
        self._recomputes = 0
        self._hooks = []
        for i, router in enumerate(self._routers.modules):
            self._hooks.append(router.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True))
            self._hooks.append(router.register_forward_hook(self._make_post_hook(i)))

    # ---- contexts ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        """RECORD the top-k ids of every forward inside; on exit `Recording.routes` holds them per sequence."""
        recording = Recording()
        self._enter(_RECORD)
        ok = False
        try:
            yield recording
            ok = True
        finally:
            pending, self._pending = self._pending, []
            self._leave()
        if ok:
            recording.routes = self._finish_record(pending)

    @contextlib.contextmanager
    def replay(self, routes: RouteStore) -> Iterator[RoutingReplay]:
        """Replay `routes` in every forward inside (and in activation recompute). Use one context per
        forward_backward call: entering resets megatron's recompute FIFO."""
        if routes.num_experts != self.num_experts or routes.topk != self.topk:
            raise ValueError(
                f"routes are for {routes.num_experts} experts top-{routes.topk}; the model has "
                f"{self.num_experts} experts top-{self.topk}"
            )
        missing = [layer for layer in self.layer_ids if layer not in routes.layer_ids]
        if missing:
            raise ValueError(f"routes hold layers {list(routes.layer_ids)}; this rank needs layer {missing[0]}")
        self._enter(_REPLAY)
        self._store = routes
        try:
            yield self
        finally:
            self._leave()

    @contextlib.contextmanager
    def off(self) -> Iterator[RoutingReplay]:
        """Route normally inside (the default outside any context)."""
        self._enter(_OFF)
        try:
            yield self
        finally:
            self._leave()

    def _enter(self, phase: str) -> None:
        if self._phase != _OFF:
            raise RuntimeError(f"RoutingReplay is already in a {self._phase} context; contexts do not nest")
        self._routers.clear()
        self._action = None
        self._targets = None
        self._pending = []
        self._recomputes = 0
        self._phase = phase

    def _leave(self) -> None:
        self._phase = _OFF
        self._store = None
        self._targets = None
        self._routers.clear()
        self._action = None

    # ---- per micro-batch ---------------------------------------------------------------------------------
    def set_microbatch(self, seq_indices: Sequence[int], layout: TokenLayout) -> None:
        """Declares the next forward's micro-batch: which sequences (keys of the RouteStore) sit where.

        Call it in the schedule's forward_step, before the model forward, on every pipeline stage. Outside a
        record / replay context it does nothing."""
        if self._phase == _OFF:
            return
        seq_indices = tuple(int(i) for i in seq_indices)
        if len(seq_indices) != layout.num_sequences:
            raise ValueError(f"{len(seq_indices)} sequence indices for a layout of {layout.num_sequences} sequences")
        layout.check_split(self.placement.token_split)
        if self._phase == _RECORD:
            self._pending.append(_PendingMicroBatch(seq_indices, layout, [None] * len(self.layer_ids)))
        else:
            self._targets = self.routes_for_microbatch(seq_indices, layout)
            self._routers.set_replay_data(self._targets)

    def routes_for_microbatch(self, seq_indices: Sequence[int], layout: TokenLayout) -> list[torch.Tensor]:
        """RouterReplay targets of this rank for a micro-batch of the replayed RouteStore: per local layer an int64
        [local tokens, K] tensor in the router's token order, on the routers' device."""
        if self._store is None:
            raise RuntimeError("routes_for_microbatch needs an active replay(routes) context")
        return self._store.routes_for_microbatch(
            seq_indices,
            layout,
            layer_ids=self.layer_ids,
            split_rank=self.placement.split_rank,
            split_size=self.placement.token_split,
            device=self.placement.device,
        )

    @property
    def recompute_replays(self) -> int:
        """Router calls that replayed with REPLAY_BACKWARD (activation recompute) in the current / last context."""
        return self._recomputes

    # ---- hooks -------------------------------------------------------------------------------------------
    def _set_action(self, action: str | None) -> None:
        if action != self._action:
            self._routers.set_action(action)
            self._action = action

    def _make_pre_hook(self, layer: int):
        def pre_hook(module, args, kwargs):
            if self._phase == _OFF:
                self._set_action(None)
                return None
            recompute = in_recompute()
            if self._phase == _RECORD:
                if recompute:
                    self._set_action(None)
                    return None
                if not self._pending:
                    raise RuntimeError(
                        "a router ran inside RoutingReplay.record() before set_microbatch(): call "
                        "set_microbatch(seq_indices, layout) in forward_step before the model forward"
                    )
                self._check_tokens(layer, args, kwargs, self._pending[-1].layout.local_tokens(self.placement.token_split))
                self._set_action("record")
                return None
            if recompute:
                self._recomputes += 1
                self._set_action("replay_backward")
                return None
            if self._targets is None:
                raise RuntimeError(
                    "a router ran inside RoutingReplay.replay() before set_microbatch(): call "
                    "set_microbatch(seq_indices, layout) in forward_step before the model forward"
                )
            self._check_tokens(layer, args, kwargs, self._targets[layer].shape[0])
            self._set_action("replay_forward")
            return None

        return pre_hook

    def _make_post_hook(self, layer: int):
        def post_hook(module, args, output):
            if self._phase != _RECORD or in_recompute():
                return None
            slot = self._pending[-1].layers
            if slot[layer] is not None:
                raise RuntimeError(
                    f"layer {self.layer_ids[layer]} ran twice for one micro-batch inside record(); call "
                    "set_microbatch before every forward"
                )
            ids = self._routers.recorded(layer)
            if ids is None:
                raise RuntimeError(f"layer {self.layer_ids[layer]} recorded nothing (is router fusion on?)")
            slot[layer] = ids.detach().to(compact_expert_dtype(self.num_experts))
            return None

        return post_hook

    def _check_tokens(self, layer: int, args, kwargs, expected: int) -> None:
        hidden = args[0] if args else kwargs.get("input")
        got = hidden.shape[0] * hidden.shape[1] if hidden is not None and hidden.dim() == 3 else None
        if got is not None and got != expected:
            raise ValueError(
                f"router of layer {self.layer_ids[layer]} sees {got} tokens ({tuple(hidden.shape[:2])} as [s, b]) "
                f"but set_microbatch declared {expected} for this rank; the TokenLayout must describe the model "
                "input exactly (seq_length = padded / packed length, micro_batch_size = rows)"
            )

    # ---- recorded ids -> per-sequence routes -------------------------------------------------------------
    def _finish_record(self, pending: list[_PendingMicroBatch]) -> RouteStore:
        store = RouteStore(self.num_experts, self.topk, self.layer_ids)
        for m, mb in enumerate(pending):
            missing = [self.layer_ids[i] for i, t in enumerate(mb.layers) if t is None]
            if missing:
                raise RuntimeError(f"micro-batch {m} of record() never ran layer {missing[0]} on this rank")
        if not pending:
            return store
        local = [torch.stack(mb.layers, dim=1) for mb in pending]  # [local tokens, L, K] each
        split = self.placement.token_split
        if split > 1:
            parts = _all_gather_cat(torch.cat(local, dim=0), self._routers.tp_group(), split)
        else:
            parts = [torch.cat(local, dim=0)]
        offset = 0
        for mb, mine in zip(pending, local):
            n = mine.shape[0]
            s_local = mb.layout.seq_length // split
            grid = torch.cat(
                [p[offset : offset + n].view(s_local, mb.layout.micro_batch_size, *mine.shape[1:]) for p in parts],
                dim=0,
            )
            offset += n
            grid = grid.to(self.store_device)
            for index, routes_TLK in zip(mb.seq_indices, gather_from_grid(grid, mb.layout)):
                store.add(index, routes_TLK, validate=False)
        return store

    def gather_pipeline_layers(self, routes: RouteStore) -> RouteStore:
        """All pipeline stages' layers of a recorded store, on every stage (collective over the PP group; every
        stage must hold the same sequences). For metrics and R3-style export; replay needs only local layers."""
        if self._routers.pp_size() == 1:
            return routes
        return gather_layers(routes, self._routers.pp_group(), device=self.placement.device)

    def metrics(self, routes: RouteStore) -> dict[str, float]:
        """`routes_memory_bytes`: bytes this rank keeps for the rollout batch's routes (plus their token count)."""
        return route_metrics(routes)

    def close(self) -> None:
        """Removes the hooks and empties megatron's RouterReplay registry (safe to call twice)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._routers is not None:
            self._routers.release()
            self._routers = None


def route_metrics(routes: RouteStore) -> dict[str, float]:
    """Size of a rollout batch's stored routes: `routes_memory_bytes` and `routes_tokens`."""
    return {"routes_memory_bytes": float(routes.memory_bytes()), "routes_tokens": float(routes.num_tokens())}


def _all_gather_cat(local: torch.Tensor, group, world: int) -> list[torch.Tensor]:
    """All-gather equally shaped compact tensors (as bytes, so any integer dtype travels) -> per-rank tensors."""
    as_bytes = local.contiguous().view(torch.uint8)
    out = [torch.empty_like(as_bytes) for _ in range(world)]
    dist.all_gather(out, as_bytes, group=group)
    return [t.view(local.dtype) for t in out]


def gather_layers(routes: RouteStore, group, device: torch.device | str = "cpu") -> RouteStore:
    """Union of the layers of `routes` over the ranks of `group` (pipeline stages), on every rank of the group.

    Every rank must hold the same sequence indices with the same token counts (stages see the same batches).
    `device`: where the all-gather's buffers live (the model's device; NCCL takes CUDA tensors only)."""
    world = dist.get_world_size(group)
    meta = (routes.layer_ids, [(i, routes[i].shape[0]) for i in routes.seq_indices])
    metas: list = [None] * world
    dist.all_gather_object(metas, meta, group=group)
    if any(m[1] != meta[1] for m in metas):
        raise ValueError("pipeline stages hold routes for different sequences; record the same batches on every stage")
    n_max = max(len(m[0]) for m in metas)
    seqs = routes.seq_indices
    flat = (
        torch.cat([routes[i] for i in seqs], dim=0)
        if seqs
        else torch.empty(0, len(routes.layer_ids), routes.topk, dtype=routes.dtype)
    )
    store_device = flat.device
    flat = flat.to(device)
    padded = torch.zeros(flat.shape[0], n_max, routes.topk, dtype=flat.dtype, device=flat.device)
    padded[:, : flat.shape[1]] = flat
    parts = _all_gather_cat(padded, group, world)
    layer_ids = sorted(layer for m in metas for layer in m[0])
    if len(layer_ids) != len(set(layer_ids)):
        raise ValueError("pipeline stages hold overlapping layers")
    by_layer = {}
    for (ids, _), part in zip(metas, parts):
        for j, layer in enumerate(ids):
            by_layer[layer] = part[:, j]
    full = torch.stack([by_layer[layer] for layer in layer_ids], dim=1).to(store_device)
    out = RouteStore(routes.num_experts, routes.topk, layer_ids)
    offset = 0
    for i in seqs:
        n = routes[i].shape[0]
        out.add(i, full[offset : offset + n], validate=False)
        offset += n
    return out
