"""What both dist_checkpointing parts of a checkpoint (the model, checkpoint/model_io.py, and the optimizer state,
checkpoint/optimizer_io.py) are written and read with."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def require_dist() -> None:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call megatron_gspo.parallel.initialize")


def rank0(action: Callable[[], Any], what: str) -> None:
    """Runs `action` on rank 0 and tells every rank whether it worked (all raise if it did not)."""
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as err:  # noqa: BLE001 - re-raised below on every rank
            error = err
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RuntimeError(f"{what} failed on rank 0: {box[0]}")


@contextlib.contextmanager
def quiet_dcp():
    """Hides the FutureWarnings megatron-core 0.16's torch_dist code triggers in PyTorch DCP (deprecated
    `load_state_dict` / ShardedTensor): not actionable for users."""
    with warnings.catch_warnings():
        for module in (r"torch\.distributed\.checkpoint", r"megatron\.core\.dist_checkpointing"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        yield


def dist_save_strategy():
    """torch_dist (PyTorch DCP) written synchronously by each rank.

    megatron-core's own torch_dist writer forks one worker process per file bucket and needs `psutil`, which is not
    a megatron-core dependency (without it the workers die and the save hangs); forking also does not mix well with
    open gloo/NCCL groups. The files are the same format: megatron's default torch_dist loader reads them.
    """
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp.save(
                mcore_to_pyt_state_dict(flat, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=MCoreSavePlanner(flatten_state_dict=False),
            )

    return InProcessTorchDistSave("torch_dist", 1)
