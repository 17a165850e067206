"""Rank function of the planner = trainer test: what the trainer's default Megatron set-up allocates on this rank."""

from __future__ import annotations


def trainer_memory_terms(layout: dict) -> dict:
    """Params (dense / expert), fp32 main-grad buffer elements and fp32 optimizer master elements this rank holds
    with the trainer's default optimizer (OptimConfig()), for the tiny preset; and the DDP flags they come from."""
    from megatron_gspo.models.config import preset
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, build_ddp_model, build_optimizer, unwrap
    from tests.training.optimizer_state import local_masters

    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=1)
    try:
        optim = OptimConfig()
        chunks = build_ddp_model(preset("tiny"), parallel, optim=optim)
        opt = build_optimizer(chunks, optim)
        params = [p for c in chunks for p in unwrap(c).parameters()]
        found, _ = local_masters(opt)
        dense_masters = sum(e - s for p, (_, s, e, _) in found.items() if getattr(p, "allreduce", True))
        expert_masters = sum(e - s for p, (_, s, e, _) in found.items() if not getattr(p, "allreduce", True))
        buffers = [b for c in chunks for b in (*c.buffers, *c.expert_parallel_buffers)]
        return dict(
            dense=sum(p.numel() for p in params if getattr(p, "allreduce", True)),
            expert=sum(p.numel() for p in params if not getattr(p, "allreduce", True)),
            grad_elements=sum(b.grad_data.numel() for b in buffers),
            grad_dtypes={str(b.grad_data.dtype) for b in buffers},
            dense_masters=dense_masters,
            expert_masters=expert_masters,
            distributed=chunks[0].ddp_config.use_distributed_optimizer,
        )
    finally:
        shutdown()
