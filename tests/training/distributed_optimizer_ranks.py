"""Rank function of the distributed-optimizer tests: two AdamW steps on the same batch in any layout, with the
distributed optimizer (sharded fp32 masters and moments) or megatron's plain one (the single-process reference)."""

from __future__ import annotations

import torch

from tests.models.parity import BATCH, MICRO, SEQ, batch, hf_state_dict, tiny_config

AUX = {"router_aux_loss_coef": 0.01}
ADAM = dict(lr=1e-2, eps=1e-3, beta2=0.99, clip_grad=1.0, weight_decay=0.01)
"""AdamW with gradient clipping (the global grad norm over shards) and weight decay. eps = 1e-3 bounds the
update's sensitivity to the gradient (|d update| <= lr / eps |d grad|): with eps 1e-8 a gradient element near 0
flips its Adam step between +lr and -lr on a rounding difference of the reduction order, which is no error."""


def adam_steps(layout: dict, dtypes: list[str], distributed: bool, steps: int = 2, overlap: bool = False) -> dict:
    """{dtype: {"loss", "grad_norm" (per step), "state" (full HF-named weights / masters / moments), "types",
    "local_masters" / "total_params" (elements)}}: HF weights loaded, `steps` optimizer steps on one batch."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import (
        OptimConfig,
        build_ddp_model,
        build_optimizer,
        finish_param_gather,
        forward_backward,
        unwrap,
    )
    from tests.training.optimizer_state import full_optimizer_state, local_master_numel

    cfg = tiny_config(**AUX)
    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=7)
    out: dict = {}
    try:
        for name in dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            optim = OptimConfig(distributed=distributed, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                bucket_size=4096 if overlap else None, **ADAM)
            chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=dtype), optim)
            opt = build_optimizer(chunks, optim, dtype)
            models = [unwrap(c) for c in chunks]
            load_hf_state_dict(models, hf_state_dict(cfg))
            opt.reload_model_params()
            data = batch(cfg)
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            micro = list(data.chunk(dp)[dp_rank].chunk(MICRO // dp))
            positions = torch.arange(SEQ).unsqueeze(0)

            def forward_step(mb, model):
                ids, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
                logits = model(ids, positions.expand(ids.shape[0], -1), None, labels=labels)
                return logits, lambda t: (t.sum(), torch.tensor(t.numel(), dtype=torch.int), {"loss_sum": t.sum().detach()})

            losses, norms = [], []
            for _ in range(steps):
                parts = forward_backward(chunks, micro, forward_step, seq_length=SEQ, micro_batch_size=micro[0].shape[0],
                                         units_of=lambda mb: mb[:, 1:].numel())
                loss = torch.tensor(sum(float(p["loss_sum"]) for p in parts), dtype=torch.float64)
                torch.distributed.all_reduce(loss)  # the last stage's sums, once per TP rank
                losses.append(float(loss) / ps.get_tensor_model_parallel_world_size() / (BATCH * SEQ))
                ok, norm, _ = opt.step()
                assert ok
                norms.append(float(norm))
            if overlap:
                # Only this rank's shards are updated until the gather completes (the next forward, or this).
                stale = {k: v.float() for k, v in export_hf_state_dict(models).items()}
                finish_param_gather(chunks)
            out[name] = dict(
                stale=stale if overlap else None,
                loss=losses,
                grad_norm=norms,
                weights={k: v.float() for k, v in export_hf_state_dict(models).items()},
                state=full_optimizer_state(chunks, opt),
                types=sorted({type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])}),
                local_masters=local_master_numel(opt),
                total_params=sum(p.numel() for m in models for p in m.parameters()),
            )
        return out
    finally:
        shutdown()
