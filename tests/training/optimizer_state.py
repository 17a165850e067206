"""Test helper: the full optimizer state of any megatron optimizer (plain fp32, mixed precision, distributed) in
any layout, as HF-named fp32 tensors, so runs in different layouts (and checkpoints of them) compare directly.

Read from megatron-core 0.16's own fields: `DistributedOptimizer` keeps, per model param, a flat shard of its
fp32 master (`shard_fp32_from_float16_groups` / `shard_fp32_groups`, range `_get_model_param_range_map(p)`)
on one data-parallel rank; `Float16OptimizerWithFloat16Params` a full fp32 copy (`fp32_from_float16_groups`);
`FP32Optimizer` the param itself. Adam's moments are torch's `optimizer.state[master]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

KEYS = ("param", "exp_avg", "exp_avg_sq")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def local_masters(optimizer) -> tuple[dict, bool]:
    """{model param: (master tensor, start, end, torch optimizer)} of this rank, and whether it is sharded."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found: dict = {}
    sharded = False
    for opt in _sub_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            sharded = True
            for model_groups, shard_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                               (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for model_group, shard_group in zip(model_groups, shard_groups):
                    for p, shard in zip(model_group, shard_group):
                        r = opt._get_model_param_range_map(p)["param"]
                        found[p] = (shard, r.start, r.end, opt.optimizer)
        elif hasattr(opt, "float16_groups"):
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    found[p] = (main, 0, p.numel(), opt.optimizer)
            for group in opt.fp32_from_fp32_groups:
                for p in group:
                    found[p] = (p, 0, p.numel(), opt.optimizer)
        else:
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    found[p] = (p, 0, p.numel(), opt.optimizer)
    return found, sharded


def local_master_numel(optimizer) -> int:
    """fp32 master elements this rank holds (the distributed optimizer: only its shard)."""
    found, _ = local_masters(optimizer)
    return sum(end - start for _, start, end, _ in found.values())


def full_optimizer_state(chunks, optimizer) -> dict:
    """{"param" | "exp_avg" | "exp_avg_sq": {HF name: full fp32 tensor}, "step": Adam's step count}, the same on
    every rank (collectives inside: every rank calls). Moments are zeros before the first step."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.models.hf_state import export_hf_state_dict
    from megatron_gspo.training.engine import unwrap

    models = [unwrap(c) for c in chunks]
    params = [p for m in models for p in m.parameters()]
    found, sharded = local_masters(optimizer)
    out: dict = {}
    steps = set()
    for key in KEYS:
        values = {}
        for p in params:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if p in found:
                master, start, end, torch_opt = found[p]
                state = torch_opt.state.get(master, {})
                if "step" in state:
                    steps.add(int(state["step"]))
                src = master if key == "param" else state.get(key)
                if src is not None:
                    full[start:end] = src.detach().view(-1).float()
            if sharded:
                # Each element lives on exactly one rank of the param's data-parallel group; the others add zeros.
                expert = not getattr(p, "allreduce", True)
                group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group(
                    with_context_parallel=True)
                dist.all_reduce(full, group=group)
            values[p] = full.view(p.shape)
        out[key] = {k: v.cpu() for k, v in export_hf_state_dict(models, values=values).items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(steps))
    out["step"] = sorted({s for r in everyone for s in r})
    return out
