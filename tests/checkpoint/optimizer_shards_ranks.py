"""Rank function of the per-rank optimizer-shard test (issue 25, item 5): a DP=2 distributed optimizer (bf16
params, fp32 masters) takes a step, writes its optimizer checkpoint, and reports what each rank wrote and held;
a second optimizer loads it; then a rank file is removed and the load must fail naming it."""

from __future__ import annotations

from pathlib import Path

import torch


def _build(cfg, parallel, optim):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_gspo.models.build import BuildOptions
    from megatron_gspo.training.engine import build_ddp_model, build_optimizer

    chunks = build_ddp_model(cfg, parallel, BuildOptions(dtype=torch.bfloat16), optim)
    opt = build_optimizer(chunks, optim, torch.bfloat16)
    sched = OptimizerParamScheduler(opt, init_lr=1e-2, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                    lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
                                    wd_incr_style="constant")
    return chunks, opt, sched


def save_shards_and_reload(root: str) -> dict:
    """{"mine": bytes of the optimizer files this rank wrote, "state": bytes of the whole fp32 optimizer state
    (masters + 2 moments), "held": bytes of the DP-group state gathered in this rank's memory by megatron's
    fully_reshardable save (0: not called), "equal": the reloaded state is the saved one (bit-equal),
    "missing": the error of a load without rank 1's file, "earlier": a checkpoint of the earlier format loads
    bit-equal}."""
    import torch.distributed as dist
    from megatron.core.optimizer import distrib_optimizer

    from megatron_gspo.checkpoint.integrity import owned_by_rank
    from megatron_gspo.checkpoint.optimizer_io import load_optimizer_checkpoint, write_optimizer_checkpoint
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from megatron_gspo.training.engine import OptimConfig, unwrap
    from tests.models.parity import tiny_config
    from tests.training.optimizer_state import full_optimizer_state

    cfg, parallel = tiny_config(), ParallelConfig()
    initialize(parallel, seed=3)
    held = [0]
    gather = distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero

    def measured(self, *args, **kwargs):
        # The state megatron's fully_reshardable save gathers into this rank's host memory (its DP group's).
        out = gather(self, *args, **kwargs)
        held[0] += sum(t.numel() * t.element_size() for t in _tensors(out))
        return out

    distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero = measured
    try:
        optim = OptimConfig(distributed=True, lr=1e-2)
        chunks, opt, sched = _build(cfg, parallel, optim)
        g = torch.Generator().manual_seed(11 + dist.get_rank())
        for p in unwrap(chunks[0]).parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g) * 1e-3)
        ok, _, _ = opt.step()
        assert ok
        saved = full_optimizer_state(chunks, opt)
        write_optimizer_checkpoint(chunks, opt, sched, Path(root))
        held_by_save = held[0]
        rank = dist.get_rank()
        opt_dir = Path(root) / "optimizer"
        mine = sum(f.stat().st_size for f in opt_dir.rglob("*") if f.is_file() and owned_by_rank(f.name, rank))
        total = sum(p.numel() for p in unwrap(chunks[0]).parameters())

        chunks2, opt2, sched2 = _build(cfg, parallel, optim)
        for m2, m in zip(chunks2, chunks):  # the model load a resume does first
            unwrap(m2).load_state_dict(unwrap(m).state_dict())
        load_optimizer_checkpoint(chunks2, opt2, sched2, Path(root))
        loaded = full_optimizer_state(chunks2, opt2)
        equal = all(torch.equal(loaded[k][n], v) for k in ("param", "exp_avg", "exp_avg_sq")
                    for n, v in saved[k].items()) and loaded["step"] == saved["step"] == [1]
        # A checkpoint of the earlier format (megatron's fully_reshardable, gathered on DP rank 0) still loads.
        _write_earlier_format(chunks, opt, sched, Path(root + "_earlier"))
        chunks3, opt3, sched3 = _build(cfg, parallel, optim)
        for m3, m in zip(chunks3, chunks):
            unwrap(m3).load_state_dict(unwrap(m).state_dict())
        load_optimizer_checkpoint(chunks3, opt3, sched3, Path(root + "_earlier"))
        earlier = full_optimizer_state(chunks3, opt3)
        earlier_equal = all(torch.equal(earlier[k][n], v) for k in ("param", "exp_avg", "exp_avg_sq")
                            for n, v in saved[k].items()) and earlier["step"] == [1]
        # A load that fails on one rank only fails on every rank, in one line naming it: the other rank must not
        # go on alone into the next collective.
        from megatron_gspo.checkpoint import optimizer_io

        real_load, alone = optimizer_io.load_shards, None
        if rank == 1:
            def broken(*args, **kwargs):
                raise ValueError(f"optimizer checkpoint {root} cannot be read here")

            optimizer_io.load_shards = broken
        try:
            load_optimizer_checkpoint(chunks2, opt2, sched2, Path(root))
        except ValueError as err:
            alone = str(err)
        finally:
            optimizer_io.load_shards = real_load
        dist.barrier()
        missing = None
        if rank == 0 and (opt_dir / "rank_00001.pt").is_file():
            (opt_dir / "rank_00001.pt").unlink()
        dist.barrier()
        try:
            load_optimizer_checkpoint(chunks2, opt2, sched2, Path(root))
        except ValueError as err:
            missing = str(err)
        return dict(mine=mine, state=3 * 4 * total, held=held_by_save, equal=equal, missing=missing, earlier=earlier_equal,
                    alone=alone,
                    moments=max(v.abs().max().item() for v in saved["exp_avg"].values()))
    finally:
        distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero = gather
        shutdown()


def _write_earlier_format(chunks, optimizer, scheduler, path: Path) -> None:
    """The distributed optimizer's checkpoint as checkpoint/optimizer_io.py wrote it before the shard format."""
    from megatron_gspo.checkpoint.dist_io import dist_save, rank0
    from megatron_gspo.checkpoint.model_io import model_sharded_state_dict
    from megatron_gspo.checkpoint.optimizer_io import SHARDED_METADATA, _parts

    root = path / "optimizer"
    sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=False, metadata=SHARDED_METADATA)
    parts = _parts(sharded, optimizer)
    state = {"format": "distributed",
             "param_state": {str(i): p["param_state"] for i, p in enumerate(parts) if p["param_state"] is not None},
             "param_groups": [g for p in parts for g in p["optimizer"]["param_groups"]],
             "grad_scaler": [p.get("grad_scaler") for p in parts], "scheduler": scheduler.state_dict()}
    rank0(lambda: root.mkdir(parents=True, exist_ok=True), f"creating {root}")
    dist_save(state, str(root))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
