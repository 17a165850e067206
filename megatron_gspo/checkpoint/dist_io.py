"""What both dist_checkpointing parts of a checkpoint (the model, checkpoint/model_io.py, and the optimizer state,
checkpoint/optimizer_io.py) are written and read with."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_gspo.checkpoint.async_writes import DeferredFailures, results_queue_dying_with_us
from megatron_gspo.errors import RankFailed, describe


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
    raise_rank0_failure(error, what)


def raise_rank0_failure(error: BaseException | None, what: str) -> None:
    """All ranks call: rank 0 passes its failure at `what` (None: none) and raises it; the others raise RankFailed
    with its line."""
    box = [None if error is None else describe(error)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RankFailed(what, 0, box[0])


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
    (checkpoint/async_writes.py); its finalize functions write the DCP metadata and metadata.json.

    Both go through megatron's asynchronous save API (a synchronous save is a request whose writes are already
    done) so that the writes rank 0 alone does in the finalize functions (DCP `.metadata`, metadata.json) cannot
    hang the others: megatron-core 0.16.1 follows each with a collective that a raising rank 0 would skip; their
    failures are kept (`DeferredFailures`) and raised after the last collective: by a synchronous save on every
    rank, by an asynchronous one on rank 0 when it is finished (async_writes.AsyncWrites.finish), where the
    caller's agreement makes every rank raise."""
    from megatron.core import dist_checkpointing

    failures = DeferredFailures()
    if asynchronous:
        results_queue_dying_with_us()
    strategy = _async_strategy(failures) if asynchronous else _sync_strategy()
    with quiet_dcp():
        request = dist_checkpointing.save(state, directory, sharded_strategy=strategy, async_sharded_save=True)
    _guard_metadata_json(request, strategy, directory, failures)
    request.finalize_fns.append(failures.raise_first)
    if asynchronous:
        return request
    assert request.async_fn is None  # written in place by _sync_strategy's writer
    for fn in request.finalize_fns[:-1]:
        fn()
    # Every rank raises rank 0's failure here, so that none goes on into the caller's next collective alone.
    rank0(failures.raise_first, f"writing {directory}")
    return None


def _guard_metadata_json(request, strategy, directory: str, failures: DeferredFailures) -> None:
    """Replaces megatron's finalize function that writes metadata.json (rank 0, then a barrier) by one whose rank-0
    write cannot skip the barrier."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    last = request.finalize_fns[-1]
    if getattr(last, "__name__", None) != "metadata_finalize_fn":
        raise RuntimeError(f"megatron-core changed dist_checkpointing.save's finalize functions ({last!r}): "
                           "megatron-gspo supports megatron-core 0.16.1")

    def metadata_json() -> None:
        if dist.get_rank() == 0:
            failures.guard(save_config)(CheckpointingConfig(strategy.backend, strategy.version), directory)
        dist.barrier()

    request.finalize_fns[-1] = metadata_json


ASYNC_WRITERS = 2
"""Writer processes per rank (files per rank) of an asynchronous save (megatron's torch_dist default)."""


def _async_strategy(failures: DeferredFailures):
    """megatron's own torch_dist strategy, whose `async_save` hands back an AsyncRequest (it needs `psutil`: its
    writer processes measure their memory, and one that cannot dies before reporting, which hangs the save). Rank
    0's write of the DCP `.metadata` (`storage_writer.finish`, called in megatron's finalize before the broadcast
    of the writers' failure flag) is guarded: its failure is raised after the collectives."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class AsyncTorchDistSave(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            writer.finish = failures.guard(writer.finish)
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    return AsyncTorchDistSave("torch_dist", 1, thread_count=ASYNC_WRITERS)


def _sync_strategy():
    """torch_dist (PyTorch DCP) written synchronously by each rank, in this process (PyTorch's FileSystemWriter,
    files fsynced; its `.metadata` write is inside DCP's own collective error handling), as an "asynchronous"
    request with nothing left to write: megatron-core's synchronous torch_dist save runs its asynchronous writer in
    place, which forks one process per file, a cost with nothing to overlap when the caller waits anyway. Same
    format: megatron's torch_dist loader reads both."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def async_save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(
                mcore_to_pyt_state_dict(flat, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=MCoreSavePlanner(flatten_state_dict=False),
            )
            return AsyncRequest(None, (), [])

    return InProcessTorchDistSave("torch_dist", 1)
