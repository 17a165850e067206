"""Rank function of the colocated-memory test: offload / reload of the training state around one step."""

from __future__ import annotations

import torch

from tests.training.distributed_optimizer_ranks import ADAM, AUX


def offload_round_trip(layout: dict, dtype: str = "bf16") -> dict:
    """Two identical runs from the same HF weights (one process group): A steps twice; B steps, moves its state to
    host memory and back (with the fp32 masters), then steps again. Returns the state of B before the offload and
    after the reload, what the offload freed, and the weights / grad norms of both second steps."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import (
        OptimConfig,
        build_ddp_model,
        build_optimizer,
        forward_backward,
        unwrap,
    )
    from megatron_gspo.training.offload import StateOffload
    from tests.models.parity import MICRO, SEQ, batch, hf_state_dict, tiny_config

    cfg = tiny_config(**AUX)
    parallel = ParallelConfig(**layout)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    initialize(parallel, seed=7)
    try:
        data = batch(cfg)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        micro = list(data.chunk(dp)[dp_rank].chunk(MICRO // dp))
        positions = torch.arange(SEQ).unsqueeze(0)

        def forward_step(mb, model):
            ids, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
            out = model(ids, positions.expand(ids.shape[0], -1), None, labels=labels)
            return out, lambda t: (t.sum(), torch.tensor(t.numel(), dtype=torch.int), {})

        def step(chunks, opt) -> float:
            forward_backward(chunks, micro, forward_step, seq_length=SEQ, micro_batch_size=micro[0].shape[0],
                             units_of=lambda mb: mb[:, 1:].numel())
            ok, norm, _ = opt.step()
            assert ok
            return float(norm)

        runs = {}
        for name in ("plain", "offloaded"):
            optim = OptimConfig(**ADAM)
            chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch_dtype), optim)
            opt = build_optimizer(chunks, optim, torch_dtype)
            load_hf_state_dict([unwrap(c) for c in chunks], hf_state_dict(cfg))
            opt.reload_model_params()
            first = step(chunks, opt)
            out = {"first": first}
            if name == "offloaded":
                offload = StateOffload(chunks, opt, masters=True)
                targets = offload.targets()
                out["before"] = [t.detach().clone() for t in targets]
                out["kinds"] = sorted({str(t.dtype) for t in targets})
                grads = {g.untyped_storage().data_ptr() for g in offload.grad_buffers()}
                out["is_grad"] = [t.untyped_storage().data_ptr() in grads for t in targets]
                cuda = torch.cuda.is_available()
                allocated = torch.cuda.memory_allocated() if cuda else 0
                out["gib"] = offload.offload()
                out["freed"] = all(t.untyped_storage().nbytes() == 0 for t in targets)
                out["device"] = str(targets[0].device)
                out["allocated_drop_gib"] = (allocated - torch.cuda.memory_allocated()) / 2**30 if cuda else None
                offload.reload()
                out["after"] = [t.detach().clone() for t in targets]
            out["second"] = step(chunks, opt)
            out["weights"] = {k: v.float() for k, v in export_hf_state_dict([unwrap(c) for c in chunks]).items()}
            runs[name] = out
        return runs
    finally:
        shutdown()
