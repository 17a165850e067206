"""Rank functions of the routing-replay tests: the tiny Qwen3-MoE with HF weights, padded / packed micro-batches,
record -> optimizer step -> replay, and a router forward hook that captures the routing actually used.

The capture hook reads the router's output routing map (independent of RouterReplay) and maps each router token
back to (sequence, position) with an explicit loop over megatron's [s, b] order (token = s * B + b; under
sequence parallel TP rank r holds rows s in [r * S / tp, (r + 1) * S / tp)), so the checks do not reuse the
package's layout code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.models.config import preset

SEQ = 16
LENGTHS = (16, 11, 7, 13, 16, 5, 9, 14)  # tokens fed per sequence (prompt + response - 1)
PROMPT_LENS = (4, 3, 2, 5, 6, 2, 3, 4)
PER_MICRO = 2


def tiny_config():
    return preset("tiny")


def hf_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights (norms 1, matrices N(0, 0.02), router N(0, 0.05)): the same in every process and
    layout, without importing transformers."""
    from megatron_gspo.models.hf_state import hf_tensor_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_tensor_shapes(tiny_config()).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
        else:
            std = 0.05 if name.endswith("mlp.gate.weight") else 0.02
            out[name] = torch.randn(shape, generator=g) * std
    return out


def sequences(seed: int = 3) -> list[torch.Tensor]:
    """Token ids per sequence: LENGTHS[i] inputs + 1 final label."""
    g = torch.Generator().manual_seed(seed)
    vocab = tiny_config().vocab_size
    return [torch.randint(1, vocab, (n + 1,), generator=g) for n in LENGTHS]


@dataclass
class MicroBatch:
    ids: torch.Tensor  # [B, S]
    labels: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, S] loss mask
    seq_indices: tuple[int, ...]
    layout: object  # TokenLayout


def make_micro_batches(seq_indices, seqs, *, packed: bool = False, per_micro: int = PER_MICRO, seq_length: int = SEQ):
    from megatron_gspo.moe import TokenLayout

    out = []
    for m in range(0, len(seq_indices), per_micro):
        idx = tuple(seq_indices[m : m + per_micro])
        lengths = [LENGTHS[i] for i in idx]
        if packed:
            layout = TokenLayout.packed(lengths, seq_length * len(idx))
        else:
            layout = TokenLayout.padded(lengths, seq_length)
        ids = torch.zeros(layout.micro_batch_size, layout.seq_length, dtype=torch.long)
        labels = torch.zeros_like(ids)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, row, start, n in zip(idx, layout.rows, layout.starts, layout.lengths):
            ids[row, start : start + n] = seqs[i][:n]
            labels[row, start : start + n] = seqs[i][1 : n + 1]
            mask[row, start : start + n] = True
        out.append(MicroBatch(ids, labels, mask, idx, layout))
    return out


def make_forward_step(replay):
    def forward_step(mb: MicroBatch, model):
        replay.set_microbatch(mb.seq_indices, mb.layout)
        positions = torch.arange(mb.layout.seq_length).unsqueeze(0).expand(mb.ids.shape[0], -1)
        out = model(mb.ids, positions, None, labels=mb.labels)

        def loss_func(per_token):
            loss = (per_token * mb.mask).sum()
            return loss, mb.mask.sum().to(torch.int), {"loss": loss.detach()}

        return out, loss_func

    return forward_step


def run(chunks, replay, micro_batches, *, forward_only: bool):
    from megatron_gspo.training.engine import forward_backward

    mb0 = micro_batches[0]
    return forward_backward(
        chunks,
        micro_batches,
        make_forward_step(replay),
        seq_length=mb0.layout.seq_length,
        micro_batch_size=mb0.layout.micro_batch_size,
        forward_only=forward_only,
    )


class Capture:
    """Router forward hooks that record the top-k sets actually routed, per call, split forward / recompute."""

    def __init__(self, replay):
        from megatron_gspo.moe.megatron_routers import in_recompute

        self.topk = replay.topk
        self.active = False
        self.forward: list[list[torch.Tensor]] = []  # per call: (layer, sets)
        self.recompute: list[tuple[int, torch.Tensor]] = []
        self.handles = []
        for layer, router in enumerate(replay._routers.modules):
            def hook(module, args, output, layer=layer):
                if not self.active:
                    return
                routing_map = output[1].detach()
                counts = routing_map.sum(dim=1)
                assert bool((counts == self.topk).all()), "a token was routed to != topk experts"
                sets = routing_map.nonzero()[:, 1].view(-1, self.topk).sort(dim=1).values
                (self.recompute if in_recompute() else self.forward).append((layer, sets))

            self.handles.append(router.register_forward_hook(hook))

    def close(self):
        for h in self.handles:
            h.remove()


def expected_local_sets(routes_by_seq, layer_pos, mb: MicroBatch, split_rank: int, split: int):
    """[local tokens, K] sorted sets the router of store layer position `layer_pos` must use, and a mask of the
    tokens that belong to a sequence (padding excluded) - by an explicit loop over megatron's token order."""
    layout = mb.layout
    b_total = layout.micro_batch_size
    s_local = layout.seq_length // split
    owner = {}
    for i, row, start, n in zip(mb.seq_indices, layout.rows, layout.starts, layout.lengths):
        for pos in range(n):
            owner[(start + pos, row)] = (i, pos)
    n_tok = s_local * b_total
    topk = next(iter(routes_by_seq.values())).shape[2]
    out = torch.full((n_tok, topk), -1, dtype=torch.long)
    real = torch.zeros(n_tok, dtype=torch.bool)
    for t in range(n_tok):
        s = split_rank * s_local + t // b_total
        b = t % b_total
        if (s, b) in owner:
            i, pos = owner[(s, b)]
            out[t] = routes_by_seq[i][pos, layer_pos].long().sort().values
            real[t] = True
    return out, real


def check_capture(calls, routes_by_seq, store_layers, replay, micro_batches, *, backward: bool = False) -> dict:
    """Compares captured calls with the routes. Calls come in schedule order: per micro-batch, the local layers
    in order (forward) or in reverse order (recompute inside the backward pass)."""
    n_layers = len(replay.layer_ids)
    mismatches, checked, pad_dupes = 0, 0, 0
    if len(calls) != n_layers * len(micro_batches):
        return dict(ok=False, reason=f"{len(calls)} router calls for {len(micro_batches)} micro-batches")
    for m, mb in enumerate(micro_batches):
        for j in range(n_layers):
            layer, sets = calls[m * n_layers + (n_layers - 1 - j if backward else j)]
            if layer != j:
                return dict(ok=False, reason=f"call order: got layer {layer}, expected {j}")
            pos = store_layers.index(replay.layer_ids[j])
            expected, real = expected_local_sets(
                routes_by_seq, pos, mb, replay.placement.split_rank, replay.placement.token_split
            )
            mismatches += int((sets[real] != expected[real]).any(dim=1).sum())
            checked += int(real.sum())
            pad = sets[~real]
            pad_dupes += int((pad[:, 1:] == pad[:, :-1]).any(dim=1).sum()) if pad.numel() else 0
    return dict(ok=mismatches == 0 and checked > 0, mismatches=mismatches, checked=checked, pad_dupes=pad_dupes)


def router_grad_norms(chunks) -> list[float]:
    from megatron_gspo.training.engine import unwrap

    out = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            out.append(float(layer.mlp.router.weight.main_grad.abs().sum()))
    return out


def _routes_dict(store) -> dict[int, torch.Tensor]:
    return {i: store[i].clone() for i in store.seq_indices}


def run_layouts(layouts: list[tuple[str, dict, str]]) -> dict:
    """`run_replay_layout` for each (name, parallel layout, recompute) in turn, in the same processes (the
    process group is kept; megatron's parallel state is rebuilt per layout)."""
    from megatron_gspo.parallel import shutdown

    try:
        return {name: run_replay_layout(layout, recompute) for name, layout, recompute in layouts}
    finally:
        shutdown()


def run_replay_layout(layout: dict, recompute: str = "none", lr: float = 1.0) -> dict:
    """record (step 0) -> train under replay + SGD step -> replay again (weights changed) with capture -> record
    without replay (drift). Returns checks and the recorded routes (all layers) for comparison across layouts."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.moe import RoutingReplay, store_route_change
    from megatron_gspo.parallel import ParallelConfig, initialize
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, build_optimizer, unwrap

    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=7)
    replay = None
    try:
        cfg = tiny_config()
        sgd = OptimConfig(optimizer="sgd", lr=lr, clip_grad=0.0, distributed=False)  # megatron's is Adam-only
        chunks = build_ddp_model(cfg, parallel, BuildOptions(routing_replay=True, recompute=recompute), sgd)
        load_hf_state_dict([unwrap(c) for c in chunks], hf_state_dict())
        opt = build_optimizer(chunks, sgd)
        replay = RoutingReplay(chunks, cfg.num_experts, mode="r2")
        seqs = sequences()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = list(range(len(LENGTHS)))[dp_rank::dp]
        mbs = make_micro_batches(mine, seqs)

        with replay.record() as rec:
            run(chunks, replay, mbs, forward_only=True)
        routes0 = rec.routes
        full0 = replay.gather_pipeline_layers(routes0)

        with replay.replay(routes0):
            run(chunks, replay, mbs, forward_only=False)
        opt.step()

        # after the step, replay the all-layer store (under PP: stage 1 must pick global layers 2, 3)
        capture = Capture(replay)
        capture.active = True
        with replay.replay(full0):
            run(chunks, replay, mbs, forward_only=False)
        capture.active = False
        capture.close()
        recomputes = replay.recompute_replays
        grads = router_grad_norms(chunks)
        routes_by_seq = _routes_dict(full0)
        fwd = check_capture(capture.forward, routes_by_seq, list(full0.layer_ids), replay, mbs)
        rec_check = (
            check_capture(capture.recompute, routes_by_seq, list(full0.layer_ids), replay, mbs, backward=True)
            if recompute == "full"
            else dict(ok=len(capture.recompute) == 0 and recomputes == 0)
        )

        with replay.record() as rec:
            run(chunks, replay, mbs, forward_only=True)
        group = ps.get_pipeline_model_parallel_group() if parallel.pp > 1 else None
        drift_after = store_route_change(routes0, rec.routes, group=group)
        return dict(
            seq_indices=mine,
            routes=_routes_dict(full0),
            local_layers=list(replay.layer_ids),
            forward_check=fwd,
            recompute_check=rec_check,
            recompute_calls=recomputes,
            router_grads=grads,
            drift_without_replay=drift_after["expert_drift"],
            tokens_changed=drift_after["expert_drift_tokens_changed"],
            memory=routes0.memory_bytes(),
            dtype=routes0.dtype,
        )
    finally:
        if replay is not None:
            replay.close()


def run_single_process() -> dict:
    """One process: token-order check, R2 with several micro-batches (plain and full recompute), R3 replay of
    external routes (padded and packed), and the refusals."""
    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.moe import RouteStore, RoutingReplay, TokenLayout, store_route_change
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, build_optimizer, unwrap

    parallel = ParallelConfig()
    initialize(parallel, seed=7)
    results: dict = {}
    try:
        cfg = tiny_config()
        seqs = sequences()
        all_idx = list(range(len(LENGTHS)))

        def build(recompute: str):
            chunks = build_ddp_model(cfg, parallel, BuildOptions(routing_replay=True, recompute=recompute), sgd)
            load_hf_state_dict([unwrap(c) for c in chunks], state_dict)
            return chunks

        state_dict = hf_state_dict()
        # SGD steps (the distributed optimizer is megatron's Adam-only): the drift of one plain update.
        sgd = OptimConfig(optimizer="sgd", lr=1.0, clip_grad=0.0, distributed=False)

        chunks = build("none")
        replay = RoutingReplay(chunks, cfg.num_experts, mode="r2")

        # -- token order: batched padded recording == each sequence alone (no padding, b = 1)
        with replay.record() as rec:
            run(chunks, replay, make_micro_batches(all_idx, seqs, per_micro=4), forward_only=True)
        batched = rec.routes
        alone = {}
        for i in all_idx:
            mb = make_micro_batches([i], seqs, per_micro=1, seq_length=LENGTHS[i])
            with replay.record() as rec:
                run(chunks, replay, mb, forward_only=True)
            alone[i] = rec.routes[i]
        results["order_equal"] = all(torch.equal(batched[i], alone[i]) for i in all_idx)
        results["reference_routes"] = _routes_dict(batched)
        results["order_shapes"] = [tuple(batched[i].shape) for i in all_idx]
        results["order_distinct_sequences"] = len({batched[i][:5].numpy().tobytes() for i in all_idx})

        # -- R2 over 4 micro-batches: record, SGD step, replay (drift 0) vs no replay (drift > 0)
        opt = build_optimizer(chunks, sgd)
        mbs = make_micro_batches(all_idx, seqs)
        with replay.record() as rec:
            run(chunks, replay, mbs, forward_only=True)
        old = rec.routes
        results["r2_memory"] = replay.metrics(old)
        with replay.replay(old):
            run(chunks, replay, mbs, forward_only=False)
        opt.step()
        capture = Capture(replay)
        capture.active = True
        with replay.replay(old):
            run(chunks, replay, mbs, forward_only=False)
        capture.active = False
        results["r2_grads"] = router_grad_norms(chunks)
        results["r2_check"] = check_capture(capture.forward, _routes_dict(old), list(old.layer_ids), replay, mbs)
        # replay with a different micro-batch split and a packed layout: still the recorded routes
        packed = make_micro_batches(all_idx, seqs, packed=True, per_micro=4)
        capture.forward.clear()
        capture.active = True
        with replay.replay(old):
            run(chunks, replay, packed, forward_only=False)
        capture.active = False
        results["r2_packed_check"] = check_capture(capture.forward, _routes_dict(old), list(old.layer_ids), replay, packed)
        with replay.record() as rec:
            run(chunks, replay, mbs, forward_only=True)
        new = rec.routes
        masks = {i: torch.arange(LENGTHS[i]) >= PROMPT_LENS[i] - 1 for i in all_idx}
        results["drift_without_replay"] = store_route_change(old, new, masks=masks)
        capture.forward.clear()

        # -- R3: external routes (rollout-engine storage: [T, num_layers, topk] uint8, global layer order)
        g = torch.Generator().manual_seed(11)
        given = {
            i: torch.stack(
                [torch.stack([torch.randperm(cfg.num_experts, generator=g)[: cfg.num_experts_per_tok]
                              for _ in range(cfg.num_hidden_layers)]) for _ in range(LENGTHS[i])]
            ).to(torch.uint8)
            for i in all_idx
        }
        r3 = RouteStore.from_sequences(given, cfg.num_experts)
        r3_results = {}
        for name, batches, forward_only in (
            ("old_logprob_padded", mbs, True),
            ("train_padded", mbs, False),
            ("train_packed", packed, False),
        ):
            capture.forward.clear()
            capture.active = True
            with torch.no_grad() if forward_only else torch.enable_grad(), replay.replay(r3):
                run(chunks, replay, batches, forward_only=forward_only)
            capture.active = False
            r3_results[name] = check_capture(capture.forward, given, list(r3.layer_ids), replay, batches)
        results["r3"] = r3_results
        results["r3_dtype"] = r3.dtype
        capture.close()

        # -- refusals
        errors = {}
        config = unwrap(chunks[0]).config
        replay.close()
        config.moe_router_fusion = True
        try:
            RoutingReplay(chunks, mode="r2")
        except ValueError as err:
            errors["fusion"] = str(err)
        config.moe_router_fusion = False
        try:
            RoutingReplay(chunks, mode="r3")  # the registry was emptied by close()
        except ValueError as err:
            errors["registry"] = str(err)
        try:
            RoutingReplay([chunks[0], chunks[0]], mode="r2")  # as with parallel.virtual_pp: two chunks per rank
        except ValueError as err:
            errors["chunks"] = str(err)

        # -- full recompute, one process, 4 micro-batches: REPLAY_BACKWARD pops the FIFO in order
        chunks = build("full")
        replay = RoutingReplay(chunks, mode="r2")
        good = make_micro_batches(all_idx, seqs)[0]
        bad = MicroBatch(good.ids, good.labels, good.mask, good.seq_indices, TokenLayout.padded(good.layout.lengths, 32))
        try:
            with replay.replay(r3):
                make_forward_step(replay)(bad, chunks[0])
        except ValueError as err:
            errors["tokens"] = str(err)
        results["errors"] = errors
        opt = build_optimizer(chunks, sgd)
        with replay.record() as rec:
            run(chunks, replay, mbs, forward_only=True)
        old = rec.routes
        with replay.replay(old):
            run(chunks, replay, mbs, forward_only=False)
        opt.step()
        capture = Capture(replay)
        capture.active = True
        with replay.replay(old):
            run(chunks, replay, mbs, forward_only=False)
        capture.active = False
        results["recompute_calls"] = replay.recompute_replays
        results["recompute_fwd"] = check_capture(capture.forward, _routes_dict(old), list(old.layer_ids), replay, mbs)
        results["recompute_bwd"] = check_capture(capture.recompute, _routes_dict(old), list(old.layer_ids), replay, mbs, backward=True)
        results["recompute_grads"] = router_grad_norms(chunks)
        capture.close()
        replay.close()
        return results
    finally:
        shutdown()
