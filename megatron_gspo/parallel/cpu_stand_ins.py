"""The stand-ins for `torch`, `torch.cuda` and `torch.distributed` that megatron-core's modules see on a CPU.

Installed by `cpu_backend.apply()` (its docstring and each patch there say why and when) as the `torch` global of
megatron-core's modules only: tensor factories asked for a CUDA device make CPU tensors, CUDA streams and events
are ordered no-ops, and a collective over a one-rank group is done on the spot without gloo. Code outside
megatron-core (ours, torch itself) never sees them.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "tensor",
        "arange",
        "randn",
        "rand",
        "randint",
        "randperm",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_strided",
        "as_tensor",
        "linspace",
        "eye",
    }
)

def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare integer device index means a CUDA device to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _to_cpu_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        # Pinned host memory needs a CUDA driver; plain host memory is what the CPU path uses anyway.
        kwargs["pin_memory"] = False
    return kwargs


def _redirect_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **_to_cpu_kwargs(kwargs))

    return wrapper


def _device(*args, **kwargs):
    # torch.device("cuda"), torch.device("cuda", 0), torch.device(0) -> the CPU.
    if args and (_is_cuda_device(args[0]) or args[0] == "cuda"):
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


def _autocast(device_type: str = "cpu", *args, **kwargs):
    # megatron's schedules autocast with device_type "cuda"; bf16 autocast exists on the CPU too.
    return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class _Stream:
    """Stand-in for torch.cuda.Stream: CPU ops run in program order, so waits and records are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event(_Stream):
    def record(self, *args, **kwargs):
        pass

    def elapsed_time(self, *args, **kwargs):
        return 0.0


class _CpuCuda(types.SimpleNamespace):
    """Stand-in for `torch.cuda` inside megatron-core: the CPU is device 'cpu', streams are synchronous."""

    def __init__(self, real):
        super().__init__()
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    # Device queries: tensors created with device=torch.cuda.current_device() land on the CPU.
    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def set_device(*args, **kwargs):
        pass

    # Streams and events: CPU execution is already ordered.
    Stream = _Stream
    Event = _Event

    @staticmethod
    def current_stream(*args, **kwargs):
        return _Stream()

    @staticmethod
    def default_stream(*args, **kwargs):
        return _Stream()

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(*args, **kwargs):
        pass

    @staticmethod
    def empty_cache():
        pass

    # Memory statistics are reported by megatron's logging helpers; there is no device memory to report.
    @staticmethod
    def memory_allocated(*args, **kwargs):
        return 0

    @staticmethod
    def max_memory_allocated(*args, **kwargs):
        return 0

    @staticmethod
    def memory_reserved(*args, **kwargs):
        return 0

    @staticmethod
    def max_memory_reserved(*args, **kwargs):
        return 0

    # RNG: the "CUDA" generator of the CPU path is the CPU default generator.
    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed):
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    class nvtx:  # noqa: N801 - mirrors torch.cuda.nvtx
        @staticmethod
        def range_push(*args, **kwargs):
            pass

        @staticmethod
        def range_pop(*args, **kwargs):
            pass

        @staticmethod
        def range(*args, **kwargs):
            return contextlib.nullcontext()


class _CpuTorch(types.ModuleType):
    """Module-scoped stand-in for `torch` inside megatron-core: CUDA devices become the CPU."""

    def __init__(self, real):
        super().__init__("torch")
        self._real = real
        self.cuda = _CpuCuda(real.cuda)
        self.distributed = _CpuDistributed(real.distributed)
        self.device = _device
        self.autocast = _autocast

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if name in _FACTORIES:
            value = _redirect_factory(value)
        # Cache so later lookups skip __getattr__ (megatron touches torch.* in hot loops).
        object.__setattr__(self, name, value)
        return value


class _DoneWork:
    """The handle of a collective that had nothing to exchange: complete when returned."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


@contextlib.contextmanager
def _done_coalescing():
    yield _DoneWork()


def _alone(group) -> bool:
    """Whether `group` (None: the default group) has this rank only. A rank outside the group gets -1 from
    `get_world_size`, which is not 1: megatron's own path decides what that means."""
    if group is not None and hasattr(group, "size"):
        return group.size() == 1
    return torch.distributed.get_world_size(group) == 1


def _fill(output, tensor) -> None:
    if output.data_ptr() != tensor.data_ptr() or output.shape != tensor.shape:
        output.copy_(tensor.reshape(output.shape))  # torch takes a stacked [1, N] input into an [N] output


class _CpuDistributed(types.ModuleType):
    """Stand-in for `torch.distributed` inside megatron-core: a collective over a one-rank group is what it is on
    that rank alone, with no gloo call.

    megatron runs its data-parallel reduce-scatter and all-gather (distributed optimizer), the token-count
    all-reduce and broadcast (finalize_model_grads) and the grad-norm all-reduce (clip_grads) on every optimizer
    step whatever the group size; at DP = TP = PP = 1 all five are over one rank. gloo still queues each on its
    worker thread and the caller waits for it: about 12 ms of CPU per RL step of the 64-answer default, and on a
    loaded machine much more wall time (each wait is a thread hand-off). Over one rank a sum, mean, max or
    product is the input, a broadcast changes nothing, and a gather or scatter copies the input (bit for bit:
    AVG divides by 1). Any other group size, and every other function, is torch's."""

    def __init__(self, real):
        super().__init__("torch.distributed")
        self._real = real

    def __getattr__(self, name):
        value = getattr(self._real, name)
        object.__setattr__(self, name, value)
        return value

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        if not _alone(group):
            return self._real.all_reduce(tensor, op=self._real.ReduceOp.SUM if op is None else op, group=group,
                                         async_op=async_op)
        return _DoneWork() if async_op else None

    def broadcast(self, tensor, src=None, group=None, async_op=False, **kwargs):
        if not _alone(group):
            return self._real.broadcast(tensor, src=src, group=group, async_op=async_op, **kwargs)
        return _DoneWork() if async_op else None

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        if not _alone(group):
            return self._real.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        _fill(output_tensor, input_tensor)
        return _DoneWork() if async_op else None

    def reduce_scatter_tensor(self, output, input, op=None, group=None, async_op=False):  # noqa: A002 - torch's
        if not _alone(group):
            return self._real.reduce_scatter_tensor(output, input, op=self._real.ReduceOp.SUM if op is None else op,
                                                    group=group, async_op=async_op)
        _fill(output, input)
        return _DoneWork() if async_op else None

    def _coalescing_manager(self, group=None, device=None, async_ops=False):
        if not _alone(group):
            return self._real._coalescing_manager(group, device=device, async_ops=async_ops)
        return _done_coalescing()
