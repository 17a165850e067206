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


def dist_save(state: dict, directory: str, *, asynchronous: bool = False):
    """`dist_checkpointing.save` of `state` into `directory` (all ranks call). Synchronous: the files are written
    before it returns (in-process writer below) and None is returned. `asynchronous`: the planning, common.pt and
    sharded objects are written now; the sharded tensors are written by megatron's forked writer processes
    (`FileSystemWriterAsync`, each file fsynced) from a snapshot taken when the returned `AsyncRequest` is scheduled
    (checkpoint/async_writes.py); its finalize functions write the DCP metadata and metadata.json."""
    from megatron.core import dist_checkpointing

    strategy = _async_save_strategy() if asynchronous else _sync_save_strategy()
    with quiet_dcp():
        return dist_checkpointing.save(state, directory, sharded_strategy=strategy, async_sharded_save=asynchronous)


ASYNC_WRITERS = 2
"""Writer processes per rank (files per rank) of an asynchronous save (megatron's torch_dist default)."""


def _async_save_strategy():
    """megatron's own torch_dist strategy, whose `async_save` hands back an AsyncRequest (it needs `psutil`: its
    writer processes measure their memory, and one that cannot dies before reporting, which hangs the save)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=ASYNC_WRITERS)


def _sync_save_strategy():
    """torch_dist (PyTorch DCP) written synchronously by each rank, in this process (PyTorch's FileSystemWriter,
    files fsynced): megatron-core's synchronous torch_dist save runs its asynchronous writer in place, which forks
    one process per file, a cost with nothing to overlap when the caller waits anyway. Same format: megatron's
    torch_dist loader reads both."""
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
