"""Colocated memory: while rollout servers on the trainer's GPUs generate, the trainer's optimizer state (Adam
moments), main-grad buffers and, optionally, fp32 master weights live in host memory; they come back for the
update.

Each tensor moved is one that owns its whole storage (megatron's DDP grad buffer `grad_data`, torch Adam's
`exp_avg` / `exp_avg_sq`, the fp32 master shards of a bf16 model); its storage is copied to host memory (pinned on
CUDA, so the copies are DMA) and resized to 0 bytes, which frees the device memory while every view of it
(`param.main_grad`, bucket views) stays a valid tensor object, as megatron's own `offload_grad_buffers` does; the
reload resizes it back and copies the bytes in, so the views see their data again. The grad buffers are not
copied: their contents are dead between an optimizer step and the next update (engine.forward_backward zeroes
them first), so they are freed and come back zeroed, as megatron's own reload does. The model's weights stay: the
weight sync reads them while the servers hold their memory. fp32 masters of an fp32 model are the weights
themselves (views of the param buffer) and are never moved.
"""

from __future__ import annotations

import torch

GiB = float(2**30)


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _masters(optimizer) -> list[torch.Tensor]:
    """fp32 master copies of 16-bit params (distributed: this rank's shards; plain mixed precision: full copies)."""
    out = []
    for opt in _sub_optimizers(optimizer):
        groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", [])
        out += [t for group in groups for t in group if t is not None]
    return out


class StateOffload:
    """Moves the training state named above to host memory and back (every rank, its own state)."""

    def __init__(self, chunks: list, optimizer, *, masters: bool = False):
        self.chunks = chunks
        self.optimizer = optimizer
        self.masters = masters
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    def grad_buffers(self) -> list[torch.Tensor]:
        """The DDP main-grad buffers: freed, not copied (see the module docstring)."""
        return [b.grad_data for c in self.chunks for b in (*c.buffers, *c.expert_parallel_buffers)]

    def targets(self) -> list[torch.Tensor]:
        """The tensors moved (distinct storages): grad buffers, Adam moments, optionally the fp32 masters."""
        tensors = self.grad_buffers()
        for opt in _sub_optimizers(self.optimizer):
            for state in opt.optimizer.state.values():
                tensors += [state[k] for k in ("exp_avg", "exp_avg_sq") if isinstance(state.get(k), torch.Tensor)]
        if self.masters:
            tensors += _masters(self.optimizer)
        seen, out = set(), []
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if t.numel() == 0 or ptr in seen or not _owns_storage(t):
                continue
            seen.add(ptr)
            out.append(t)
        return out

    def offload(self) -> float:
        """Copies the targets (but the grad buffers) to host memory and frees their device storage; returns the GiB
        of device memory freed. Idempotent."""
        if self._host:
            return 0.0
        moved = 0
        dead = {g.untyped_storage().data_ptr() for g in self.grad_buffers()}
        for t in self.targets():
            host = None  # a grad buffer: nothing to keep
            if t.untyped_storage().data_ptr() not in dead:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                host.copy_(t, non_blocking=t.is_cuda)
            self._host.append((t, host))
            moved += t.numel() * t.element_size()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies have landed before their source storage goes
        for t, _ in self._host:
            t.untyped_storage().resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return moved / GiB

    def reload(self) -> None:
        """Reallocates the device storages and copies the saved bytes back (a no-op when nothing is offloaded)."""
        for t, host in self._host:
            t.untyped_storage().resize_(t.numel() * t.element_size())
            if host is None:
                t.zero_()
            else:
                t.copy_(host, non_blocking=t.is_cuda)
        if torch.cuda.is_available() and self._host:
            torch.cuda.synchronize()
        self._host = []


def device_memory_gib() -> dict[str, float]:
    """Allocated / reserved / peak device memory in GiB ({} without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    return {
        "allocated": torch.cuda.memory_allocated() / GiB,
        "reserved": torch.cuda.memory_reserved() / GiB,
        "max_allocated": torch.cuda.max_memory_allocated() / GiB,
    }


class ColocatedMemory:
    """GPU memory shared with colocated SGLang servers, phase by phase.

    The servers hold their memory from the start, so the trainer's state waits in host memory until the first
    generation is over. `release` (every rank, after generation): the engine releases the servers' memory once
    all ranks are past their generation (a barrier: SGLang asserts that a server is idle when the release arrives),
    then the optimizer state and main-grad buffers (and the fp32 masters with `masters`) come back from host memory.
    `resume` (before the weight sync): they go back to host memory and the servers take their memory again.
    `metrics` records the device memory of each phase (`memory_*`)."""

    def __init__(self, engine, chunks: list, optimizer, *, masters: bool):
        self.engine = engine
        self.state = StateOffload(chunks, optimizer, masters=masters)
        self.metrics: dict = {}
        self.state.offload()

    def release(self) -> None:
        """After generation: servers give their memory up, the trainer's state comes back to the device."""
        self.engine.release_memory()
        self.state.reload()
        self.metrics.update({f"memory_{k}_gib_update": v for k, v in device_memory_gib().items()})

    def resume(self) -> None:
        """Before the weight sync: the trainer's state goes to host memory, servers take their memory back."""
        moved = self.state.offload()
        self.metrics["memory_offloaded_gib"] = moved
        self.metrics.update({f"memory_{k}_gib_rollout": v for k, v in device_memory_gib().items()})
        self.engine.resume_memory()
