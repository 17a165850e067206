"""The Megatron side of a training step: DDP-wrapped model chunks, the megatron optimizer, and one
forward/backward pass over micro-batches through `get_forward_backward_func` (pipeline schedules included).

Loss normalisation: `calculate_per_token_loss=True` makes the schedule sum the per-micro-batch losses and the
"token" counts that the loss function returns, all-reduce the counts over data-parallel ranks, and scale the
gradients by 1 / total. Our loss functions return (sum of per-unit losses, number of units) where the unit is
what the objective averages over (sequences for GSPO, tokens for token-mean GRPO and SFT), so the gradient is
exactly that of the full-batch mean, whatever the micro-batch and data-parallel split.

The MoE load-balancing loss is defined per micro-batch; its gradient is the mean over the micro-batches of all
data-parallel ranks (megatron's semantics, models/router.py). For that the routers need U / (M * DP) before the
first backward, so a training pass with the aux loss on is told how to count units (`units_of`), and the count is
checked against what the loss functions returned.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gspo.models.build import BuildOptions, build_model
from megatron_gspo.models.config import ModelConfig
from megatron_gspo.models.router import set_aux_loss_weight
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.training.optim_config import OptimConfig


def build_ddp_model(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    options: BuildOptions | None = None,
    optim: OptimConfig | None = None,
) -> list[DistributedDataParallel]:
    """Model chunks wrapped in megatron's DDP (fp32 grad buffers, gradient reduction over DP ranks).

    `optim` says how the optimizer that will step these chunks is distributed (default: OptimConfig(), the
    distributed optimizer): megatron's DDP lays out its buffers for it (padded to shard evenly over DP ranks,
    gradients reduce-scattered rather than all-reduced), so the two must agree; `build_optimizer` checks it."""
    optim = optim or OptimConfig()
    chunks = build_model(model_cfg, parallel, options)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        overlap_param_gather=optim.overlap_param_gather,
        use_distributed_optimizer=optim.distributed,
        bucket_size=optim.bucket_size,
        check_for_nan_in_grad=False,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        assert chunk.config.calculate_per_token_loss, "models/build.py sets calculate_per_token_loss"
        ddp = DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            # Buckets of non-first chunks are not overlapped with compute on CPU anyway.
            disable_bucketing=i > 0,
        )
        wrapped.append(ddp)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def build_optimizer(chunks: list, optim: OptimConfig, dtype: torch.dtype = torch.float32):
    """megatron optimizer (separate dense / expert param groups; fp32 master weights for bf16 models), sharded
    over data-parallel ranks with `optim.distributed` (megatron's DistributedOptimizer)."""
    built_for = {c.ddp_config.use_distributed_optimizer for c in chunks}
    if built_for != {optim.distributed}:
        raise ValueError(
            f"optim.distributed={optim.distributed} but the model's DDP buffers were built for "
            f"use_distributed_optimizer={sorted(built_for)}: pass the same OptimConfig to build_ddp_model"
        )
    config = OptimizerConfig(
        optimizer=optim.optimizer,
        sgd_momentum=0.0,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.beta1,
        adam_beta2=optim.beta2,
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=optim.distributed,
        overlap_param_gather=optim.overlap_param_gather,
    )
    opt = get_megatron_optimizer(config, chunks)
    chunks[0].config.grad_scale_func = opt.scale_loss
    return opt


def finish_param_gather(chunks: list) -> None:
    """Completes the all-gather of updated params (distributed optimizer with `overlap_param_gather`).

    With the overlap, `optimizer.step()` updates only this rank's shard of each param buffer; the other shards
    arrive bucket by bucket in forward pre-hooks of the next forward. Anything that reads the weights without a
    forward (weight sync to a rollout engine, checkpoints, HF export) would see a mix of new and old shards: call
    this first. megatron's `start_param_sync(force_sync=True)` waits for a gather in flight or runs one
    synchronously, and marks it done so the next forward does not gather again. A no-op without the overlap
    (the step itself gathers synchronously)."""
    for chunk in chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def unwrap(chunk):
    """The GPTModel inside a DDP (or other) wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def forward_backward(
    chunks: list,
    micro_batches: Sequence,
    forward_step: Callable,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    units_of: Callable | None = None,
) -> list:
    """Runs `forward_step(batch, model) -> (output, loss_func)` over `micro_batches` with megatron's schedule.

    Returns the loss functions' reduced outputs (last pipeline stage; empty list elsewhere). With pipeline
    parallelism on the CPU path every micro-batch must have `seq_length` x `micro_batch_size` tokens (fixed p2p
    shapes: megatron refuses `variable_seq_lengths` with the allgather dispatcher; batching/micro_batches.py).
    `units_of(micro_batch)` is the number of loss units that micro-batch's loss function returns; a training pass
    needs it when the model has the load-balancing loss on (`router_aux_loss_coef > 0`), and when given, the
    global count megatron divides the gradients by is checked against it.
    """
    fb = get_forward_backward_func()
    n_chunks = len(chunks)
    config = unwrap(chunks[0]).config

    def step(data_iterator, model):
        batch = next(data_iterator)
        return forward_step(batch, model)

    if n_chunks > 1:
        iterators = [iter(list(micro_batches)) for _ in range(n_chunks)]
    else:
        iterators = iter(list(micro_batches))
    finalize = config.finalize_model_grads_func
    if not forward_only:
        for m in chunks:
            m.zero_grad_buffer()
            # The megatron optimizer leaves `param.grad` aliasing the DDP main-grad buffer; autograd would then
            # accumulate into that buffer directly and the DDP hook would add the gradient a second time.
            for p in _parameters(m):
                p.grad = None
        if units_of is not None:
            units, num_micro = _global_units(chunks, micro_batches, units_of)
            set_aux_loss_weight(chunks, units / num_micro)
            config.finalize_model_grads_func = _checked_finalize(finalize, units)
        elif (config.moe_aux_loss_coeff or 0) > 0:
            raise ValueError(
                "forward_backward: the model has a load-balancing loss (router_aux_loss_coef > 0); pass units_of= "
                "(the loss units of a micro-batch) so its gradient can be the mean over micro-batches"
            )
    try:
        return fb(
            forward_step_func=step,
            data_iterator=iterators,
            model=chunks if n_chunks > 1 else chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    finally:
        config.finalize_model_grads_func = finalize
        if not forward_only:
            set_aux_loss_weight(chunks, None)


_PARAMETERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _parameters(chunk) -> tuple:
    """`chunk.parameters()` as a tuple kept per chunk: a DDP chunk's parameters are fixed when its grad buffers
    are built, and the walk over ~200 modules before every minibatch update is a visible share of a small step."""
    params = _PARAMETERS.get(chunk)
    if params is None:
        params = _PARAMETERS[chunk] = tuple(chunk.parameters())
    return params


def _global_units(chunks: list, micro_batches: Sequence, units_of: Callable) -> tuple[int, int]:
    """(loss units, micro-batches) of `micro_batches` summed over this rank and every data-parallel rank (one
    all-reduce): the aux-loss weight U / (micro-batches of all replicas) holds whatever each replica's count."""
    device = next(unwrap(chunks[0]).parameters()).device
    units = sum(int(units_of(mb)) for mb in micro_batches)
    local = torch.tensor([units, len(micro_batches)], dtype=torch.int64, device=device)
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        torch.distributed.all_reduce(local, group=ps.get_data_parallel_group(with_context_parallel=True))
    total_units, total_micro = local.tolist()
    return int(total_units), int(total_micro)


def _checked_finalize(finalize: Callable, expected_units: int) -> Callable:
    """megatron's finalize_model_grads, then a check that the unit count it divided by is the one the routers'
    load-balancing weight was computed from (a loss function and its `units_of` disagreeing would silently
    mis-scale the aux gradient)."""

    def checked(model, num_tokens=None, **kwargs):
        out = finalize(model, num_tokens, **kwargs)
        if num_tokens is not None and int(num_tokens.item()) != expected_units:
            raise RuntimeError(
                f"the loss functions returned {int(num_tokens.item())} loss units in total but units_of counted "
                f"{expected_units}: they must count the same units"
            )
        return out

    return checked


def is_last_stage() -> bool:
    """Whether this rank holds the LM head (the loss is computed here)."""
    return ps.is_pipeline_last_stage(ignore_virtual=True)


def broadcast_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """Sends a tensor computed on the last pipeline stage to every stage (same shape/dtype everywhere)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return values
    src = ps.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(values, src=src, group=ps.get_pipeline_model_parallel_group())
    return values


__all__ = [
    "OptimConfig",
    "build_ddp_model",
    "build_optimizer",
    "finish_param_gather",
    "forward_backward",
    "unwrap",
    "is_last_stage",
    "broadcast_from_last_stage",
    "guarded_optimizer_step",
    "schedule_shape",
]


def guarded_optimizer_step(chunks: list, optimizer, scheduler, device) -> tuple[bool, float, str | None]:
    """(stepped, grad norm, why it was skipped) of one optimizer step, skipped when any rank holds a non-finite
    gradient or the grad norm is not finite; the LR scheduler advances only with a step. `device`: the model's
    (where the flag's all-reduce buffer lives)."""
    # One flag on the device for all gradients (an all-reduce over NCCL, and one host sync). Every main_grad is
    # a view into a DDP gradient buffer (dense and expert-parallel), so one sum per buffer sees every gradient:
    # NaN / inf propagate through a sum, which reads the buffer once and writes nothing (isfinite().all() over
    # the same 1.9M-float buffer measured 20x slower on CPU). A finite sum overflowing fp32 (|g| ~ 1e38, whose
    # grad norm would be inf anyway) is skipped too.
    sums = [buf.grad_data.sum() for c in chunks for buf in (*c.buffers, *c.expert_parallel_buffers)]
    total = torch.stack(sums).sum() if sums else torch.zeros((), device=device)
    bad = (~torch.isfinite(total)).float()
    if dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        return False, float("nan"), "non-finite gradient"
    ok, grad_norm, _ = optimizer.step()
    grad_norm = float("nan") if grad_norm is None else float(grad_norm)
    if ok and math.isfinite(grad_norm):
        scheduler.step(increment=1)
        return True, grad_norm, None
    return False, grad_norm, f"non-finite grad norm ({grad_norm})"


def schedule_shape(micro: Sequence) -> tuple[int, int]:
    """(seq_length, micro_batch_size) for megatron's schedule: its fixed p2p shape when the shapes are uniform (the
    largest otherwise; with `variable_seq_lengths` megatron communicates the shapes)."""
    return (max(mb.inputs.seq_length for mb in micro), max(mb.inputs.micro_batch_size for mb in micro))
