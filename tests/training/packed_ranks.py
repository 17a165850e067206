"""Rank function: the old-policy pass (R2 recording) and one policy-gradient pass (R2 replay) of the trainer's
forward steps, for micro-batch layouts (padded / packed), log-prob paths (logits / fused) and token budgets, in
any parallel layout. Every case starts from the same HF weights; no optimizer step."""

from __future__ import annotations

import torch

from tests.models.parity import hf_state_dict, tiny_config

N, SEQ, AUX = 8, 24, 0.01
# (prompt, response) lengths: spread from 1 response token to the full row; row 0 fills all SEQ + 1 columns.
# Rows 4-7 (the second data-parallel rank's) are longer: under a 24-token budget they need 4 micro-batches, rows
# 0-3 only 2.
LENGTHS = [(5, 20), (3, 2), (6, 9), (2, 1), (4, 14), (7, 10), (2, 12), (5, 11)]


def rollout_batch(vocab: int):
    """N rollouts of the lengths above (padded to SEQ + 1 columns), advantages and an old policy set later."""
    from megatron_gspo.batching.batch import pack_rollouts
    from megatron_gspo.rollout.types import Rollout

    g = torch.Generator().manual_seed(4)
    rollouts = [
        Rollout(
            prompt_ids=torch.randint(1, vocab, (p,), generator=g).tolist(),
            response_ids=torch.randint(1, vocab, (r,), generator=g).tolist(),
            logprobs=[-1.0] * r,
            finish_reason="stop",
        )
        for p, r in LENGTHS
    ]
    return pack_rollouts(rollouts, SEQ, 0, torch.zeros(N), torch.randn(N, generator=g))


def _grads(models) -> dict:
    from megatron_gspo.models.hf_state import export_hf_state_dict

    saved = []
    for m in models:
        for p in m.parameters():
            saved.append((p, p.data))
            p.data = p.main_grad.to(p.dtype)
    grads = export_hf_state_dict(models)
    for p, d in saved:
        p.data = d
    return {k: v.float() for k, v in grads.items()}


def _gather_rows(local: torch.Tensor) -> torch.Tensor:
    """[n_local, ...] of every data-parallel rank -> [N, ...] in rank order (identity with one replica)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_data_parallel_group())
    return torch.cat(parts)


def run_cases(layout: dict, cases: list[tuple], *, recompute: str = "none", dtype: str = "fp32",
              aux: float = AUX) -> dict:
    """{case: {"old_logprobs" [N, S], "grads", "metrics", "routes", "micro_batches", "pad_routes"}} where a case is
    (batch_layout, logprob_path, micro_batch_size, max_tokens). R2: routes recorded in the old-policy pass are
    replayed in the policy-gradient pass (training/routing.py RoutingControl, as the trainer does)."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.algorithms import PolicyLossConfig, combine_metrics, make_policy_loss
    from megatron_gspo.batching.micro_batches import MicroBatcher
    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.moe import MoEConfig
    from megatron_gspo.parallel import ParallelConfig, initialize
    from megatron_gspo.training.engine import (
        OptimConfig,
        build_ddp_model,
        forward_backward,
        is_last_stage,
        schedule_shape,
        unwrap,
    )
    from megatron_gspo.training.routing import RoutingControl
    from megatron_gspo.training.steps import logprob_forward_step, policy_forward_step, policy_units

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cfg = tiny_config(router_aux_loss_coef=aux)
    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=5)
    out = {}
    routing = None
    try:
        # main_grad must be the full reduced gradient: all-reduce DDP (the distributed optimizer's reduce-scatter
        # leaves each rank only its shard of it reduced).
        chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch_dtype, recompute=recompute,
                                                            routing_replay=True), OptimConfig(distributed=False))
        models = [unwrap(c) for c in chunks]
        load_hf_state_dict(models, hf_state_dict(cfg))
        routing = RoutingControl(MoEConfig(routing_replay="r2"), chunks, cfg.num_experts, SEQ, "recompute")
        # A clip range the ratios here stay inside, and old log-probs shifted per sequence: the gradient flows for
        # every sequence with a different weight.
        loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.99, clip_high=100.0))
        batch = rollout_batch(cfg.vocab_size)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        local = batch.rows(slice(dp_rank * N // dp, (dp_rank + 1) * N // dp))
        local.seq_index_N = torch.arange(local.num_sequences)
        for case in cases:
            layout_name, path, mbs, max_tokens = case
            batcher = MicroBatcher.for_model(models[0].config, layout=layout_name, micro_batch_size=mbs,
                                             max_tokens=max_tokens)
            groups = batcher.plan(local)
            micro = batcher.build(local, groups)
            seq_length, shape_mbs = schedule_shape(micro)
            with routing.old_policy_pass(None, local), torch.no_grad():
                outs = forward_backward(chunks, micro, logprob_forward_step(cfg.vocab_size, 1.0,
                                                                            routing.before_forward,
                                                                            logprob_path=path),
                                        seq_length=seq_length, micro_batch_size=shape_mbs, forward_only=True)
            old = torch.zeros(local.num_sequences, SEQ)
            if is_last_stage():
                rows = torch.tensor([i for g in groups for i in g])
                old[rows] = torch.cat([o["token_logprobs"] for o in outs])
            shift = torch.linspace(-0.02, 0.02, N)[dp_rank * N // dp : (dp_rank + 1) * N // dp, None]
            local.old_logprobs_NS = (old + shift) * local.loss_mask_NS
            micro = batcher.build(local, groups)
            with routing.training_pass():
                parts = forward_backward(chunks, micro, policy_forward_step(loss_fn, cfg.vocab_size, 1.0,
                                                                            routing.before_forward,
                                                                            logprob_path=path),
                                         seq_length=seq_length, micro_batch_size=shape_mbs,
                                         units_of=policy_units(loss_fn))
            metrics = {k: float(v) for k, v in combine_metrics(parts).items()} if parts else None
            routes = routing.rr.gather_pipeline_layers(routing.routes)
            pad_routes = None
            if layout_name == "packed":
                # What the routers of this rank replay for the first pack: pads must get distinct experts.
                with routing.rr.replay(routing.routes):
                    targets = routing.rr.routes_for_microbatch(micro[0].seq_index_N.tolist(), micro[0].inputs.token_layout)
                pad = micro[0].inputs.padding_mask_BP[0]
                split = routing.rr.placement.token_split
                local_pad = pad.view(split, -1)[routing.rr.placement.split_rank]
                pad_routes = [t[local_pad] for t in targets]
            out[case] = {
                "old_logprobs": _gather_rows(old if is_last_stage() else torch.zeros_like(old)),
                "is_last_stage": is_last_stage(),
                "grads": _grads(models),
                "metrics": metrics,
                "routes": {i: routes[i] for i in routes.seq_indices},
                "micro_batches": [[int(x) for x in mb.seq_index_N] for mb in micro],
                "pack_lengths": [mb.inputs.seq_length for mb in micro],
                "pad_routes": pad_routes,
            }
        return out
    finally:
        if routing is not None:
            routing.close()


def run_many(jobs: list[tuple[dict, list[tuple], dict]]) -> list[dict]:
    """`run_cases(layout, cases, **kwargs)` for each job in turn, in the same processes (the process group is kept;
    megatron's parallel state is rebuilt per job)."""
    from megatron_gspo.parallel import shutdown

    try:
        return [run_cases(layout, cases, **kwargs) for layout, cases, kwargs in jobs]
    finally:
        shutdown()
