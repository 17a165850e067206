"""Process-group set-up: torch.distributed (NCCL on GPU, gloo on CPU) plus megatron's model-parallel groups."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.parallel import cpu_backend
from megatron_gspo.parallel.config import ParallelConfig


@dataclass
class DistributedEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str


def _env_int(*names: str, default: int | None = None) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as err:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from err
    return default


def _launch_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun or srun variables; (0, 1, 0) when launched alone."""
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world} (check RANK/WORLD_SIZE or SLURM_* variables)")
    return rank, world, local


def start_process_group(timeout_s: float | None = None) -> DistributedEnv:
    """Starts torch.distributed if needed: NCCL with CUDA, gloo without; a private store when alone.

    `timeout_s` bounds how long any collective of the default group waits for the other ranks (torch's default
    otherwise: 10 min for NCCL, 30 min for gloo)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        return DistributedEnv(dist.get_rank(), dist.get_world_size(), _launch_env()[2], dist.get_backend())
    rank, world, local = _launch_env()
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(local % torch.cuda.device_count())
    if world == 1 and "MASTER_ADDR" not in os.environ:
        # A single process needs no rendezvous: an in-memory store avoids binding a port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError(
                f"world size {world} needs MASTER_ADDR and MASTER_PORT (torchrun sets them; under srun export "
                "them, e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))"
            )
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return DistributedEnv(rank, world, local, backend)


def seed_everything(seed: int) -> None:
    """Seeds python, numpy, torch and megatron's model-parallel RNG tracker (TP/EP-aware streams)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize(parallel: ParallelConfig, seed: int = 1234) -> DistributedEnv:
    """Starts torch.distributed, megatron's parallel groups for `parallel`, and seeds every RNG.

    On a machine without CUDA this first applies the CPU backend (`cpu_backend.apply()`); on any machine without
    transformer-engine, megatron's router fix-up (`cpu_backend.apply_without_te()`).
    """
    cpu_backend.apply()
    cpu_backend.apply_without_te()
    from megatron.core import parallel_state

    env = start_process_group(parallel.timeout_s)
    parallel.data_parallel_size(env.world_size)  # raises a clear error when the layout does not fit
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=parallel.timeout_s / 60,
    )
    seed_everything(seed)
    return env


def shutdown() -> None:
    """Destroys megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    # megatron's aux-loss tracker is a module global sized by the first MoE model's layer count and holding its
    # process groups; the next model built in this process (another depth, new groups) needs it empty.
    get_moe_layer_wise_logging_tracker().clear()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
