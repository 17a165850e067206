"""A CPU stand-in for "the model lives on a CUDA device": finds every tensor that meets the model or a collective
from the host.

On a CPU-only machine the model and the data are on the same device, so a tensor the code forgot to move looks
exactly like one it moved. `DeviceWitness` (a `TorchFunctionMode`) separates the two while every computation still
runs for real on the CPU (real values, gloo collectives, megatron's schedules, the optimizer):

- Host tensors are the ones a GPU run would have on the CPU: made by a factory (`torch.zeros`, `torch.tensor`,
  `torch.arange`, `from_numpy`, ...) called from our code (megatron_gspo/ or tests/) without a device or with a CPU
  device, returned by `.cpu()` / `.to("cpu")` there, or computed only from host tensors. Everything else is "on the
  device": the model's parameters and whatever megatron-core allocates (on a GPU it asks for CUDA), tensors made
  with `device="cuda"` (the witness allocates them on the CPU), `.to("cuda")` / `.cuda()` copies, and every result
  of an op with a device input. `Tensor.device` / `is_cuda` answer our code accordingly (`cuda:0` for device tensors),
  so code that follows another tensor's device (`device=logits.device`, `x.to(y.device)`) behaves as on a GPU, and
  so does every check our code makes on devices (the log-prob kernel's "targets is on cpu but logits is on cuda:0").
  Other libraries (megatron-core, transformers) see the real device and take their CPU paths.
- A violation is what fails on a CUDA device: an op mixing host and device tensors (host 0-dim scalars and host
  index tensors are allowed, as CUDA allows them), a host tensor handed to a model chunk's forward, or to a
  torch.distributed collective (NCCL takes device tensors only), or `.numpy()` of a device tensor.

The witness records violations instead of raising, so one run lists them all, each with where the host tensor
was made and where it met the device. What it cannot see: devices of generators (created on the CPU here), code
paths only a GPU takes (Triton kernels: the torch backend stands in), point-to-point sends (megatron's pipeline
buffers, which it allocates itself), collectives imported by name instead of called through the
`torch.distributed` module, and the device of parameters: every `nn.Parameter` counts as on the device (the GPU
build moves the whole model with `.cuda()`, which the CPU build skips), including those our spec modules make.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

DEVICE = torch.device("cuda", 0)
"""The device the witness pretends the model lives on."""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = (os.path.join(_ROOT, "megatron_gspo") + os.sep, os.path.join(_ROOT, "tests") + os.sep)
# Frames that are plumbing, not callers: torch itself, this file, and the CPU backend's factory redirect (megatron
# asked for a CUDA tensor there).
_PLUMBING = (_TORCH_DIR, os.path.abspath(__file__),
             *(os.path.join(_ROOT, "megatron_gspo", "parallel", f) for f in ("cpu_backend.py", "cpu_stand_ins.py")))

_T = torch.Tensor
_FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor, torch.asarray,
    torch.randn, torch.rand, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.empty_strided,
    torch.scalar_tensor, torch.from_numpy,
}
# *_like and Tensor.new_*: no device argument means the input's device.
_LIKE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, _T.new_zeros, _T.new_ones, _T.new_empty, _T.new_full, _T.new_tensor,
}
_DEVICE_GETTERS = {_T.device.__get__: "device", _T.is_cuda.__get__: "is_cuda", _T.is_cpu.__get__: "is_cpu"}
_TRANSFERS = {_T.to, _T.cuda, _T.cpu, _T.copy_}
_INDEXING = {_T.__getitem__, _T.__setitem__}
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "gather", "scatter", "all_to_all",
    "all_to_all_single", "batch_isend_irecv",
)
# send / recv / isend / irecv stay unwrapped: P2POp checks its op by identity (batch_isend_irecv is checked).


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch reads a bare index as a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    elif isinstance(obj, dist.P2POp):
        out.append(obj.tensor)
    return out


def _caller() -> tuple[str, int]:
    """File and line of the innermost frame that is not plumbing."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PLUMBING):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("?", 0)


def _our_frame() -> str:
    """The innermost frame of our code (where a violation is reported)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_OURS) and not name.startswith(_PLUMBING):
            return f"{os.path.relpath(name, _ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@dataclass
class Violation:
    what: str
    """The op, collective or model that met a host tensor."""
    where: str
    """Our innermost frame at that moment."""
    made: str
    """Where the host tensor was created."""
    shape: tuple

    def __str__(self) -> str:
        return f"{self.what} at {self.where}: host tensor {list(self.shape)} made at {self.made}"


class _Generator(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_GENERATOR)


_REAL_GENERATOR = torch.Generator


class _CpuGenerator(metaclass=_Generator):
    """torch.Generator(device="cuda") cannot be faked: generators are made on the CPU while the witness runs."""

    def __new__(cls, device="cpu"):
        return _REAL_GENERATOR(device="cpu")


class DeviceWitness(TorchFunctionMode):
    """See the module docstring. Use as a context manager; `violations` lists what a CUDA device would reject."""

    def __init__(self):
        super().__init__()
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Host tensors -> where they were made."""
        self.violations: list[Violation] = []
        self.model_calls = 0
        self.collective_calls = 0
        self._stack = contextlib.ExitStack()

    # ---- context --------------------------------------------------------------------------------------------
    def __enter__(self):
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._stack.enter_context(_patched(dist, name, self._collective(name, getattr(dist, name))))
        self._stack.enter_context(_patched(torch, "Generator", _CpuGenerator))
        # The Triton kernels need a real GPU: the torch backend computes the same log-probs.
        from megatron_gspo.kernels import api
        from megatron_gspo.kernels.torch_logprob import TorchLogprobOps

        self._stack.enter_context(_patched(api, "resolve_backend", lambda backend, device: TorchLogprobOps()))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    def watch(self, models) -> None:
        """Checks every tensor argument of each model chunk's forward (GPTModel, DDP-wrapped or not)."""
        for model in models:
            while hasattr(model, "module"):
                model = model.module
            model.register_forward_pre_hook(self._model_hook, with_kwargs=True)

    # ---- checks ---------------------------------------------------------------------------------------------
    def _violation(self, what: str, host: list[torch.Tensor]) -> None:
        where = _our_frame()
        for t in host:
            self.violations.append(Violation(what, where, self.host.get(t, "?"), tuple(t.shape)))

    def _model_hook(self, module, args, kwargs):
        self.model_calls += 1
        host = [t for t in _tensors((args, kwargs), []) if t in self.host]
        if host:
            self._violation(f"{type(module).__name__}.forward", host)

    def _collective(self, name: str, fn):
        def check(*args, **kwargs):
            self.collective_calls += 1
            host = [t for t in _tensors((args, kwargs), []) if t in self.host]
            if host:
                self._violation(f"torch.distributed.{name}", host)
            return fn(*args, **kwargs)

        return check

    def _mark_host(self, out, made: str):
        for t in _tensors(out, []):
            self.host[t] = made
        return out

    # ---- the mode -------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        getter = _DEVICE_GETTERS.get(func) or ("get_device" if func is _T.get_device else None)
        if getter is not None:
            if not _caller()[0].startswith(_OURS):
                return func(*args, **kwargs)  # other libraries see the real device (and take their CPU paths)
            host = args[0] in self.host
            return {"device": torch.device("cpu") if host else DEVICE, "is_cuda": not host, "is_cpu": host,
                    "get_device": -1 if host else 0}[getter]
        if func in _FACTORIES or func in _LIKE:
            return self._factory(func, args, kwargs)
        if func in (_T.to, _T.cuda, _T.cpu):
            return self._transfer(func, args, kwargs)
        inputs = _tensors((args, kwargs), [])
        host = [t for t in inputs if t in self.host]
        device = [t for t in inputs if t not in self.host]
        if func in (_T.numpy, _T.__array__) and device and _caller()[0].startswith(_OURS):
            self.violations.append(Violation(f"Tensor.{func.__name__} of a device tensor", _our_frame(), "-",
                                             tuple(device[0].shape)))
        if host and device and func not in _TRANSFERS:
            # CUDA ops take 0-dim CPU tensors as scalars, and CPU index tensors; anything else is a mismatch.
            bad = [t for t in host if t.dim() > 0 and not (func in _INDEXING and _in_index(t, args))]
            if bad:
                self._violation(getattr(func, "__qualname__", str(func)), bad)
        out = func(*args, **kwargs)
        if host and not device:
            made = self.host[host[0]]
            for t in _tensors(out, []):
                if not any(t is i for i in inputs):
                    self.host[t] = made
        return out

    def _factory(self, func, args, kwargs):
        device = kwargs.get("device")
        if device is not None:
            on_host = not _is_cuda(device)
            if not on_host:
                kwargs["device"] = "cpu"
        elif func in _LIKE:
            on_host = args[0] in self.host
        else:
            on_host = True  # the default device is the host
        out = func(*args, **kwargs)
        file, line = _caller()
        if on_host and file.startswith(_OURS):
            self._mark_host(out, f"{os.path.relpath(file, _ROOT)}:{line}")
        return out

    def _transfer(self, func, args, kwargs):
        t, rest = args[0], {}
        if func is _T.cuda:
            target = DEVICE
        elif func is _T.cpu:
            target = torch.device("cpu")
        elif len(args) > 1 and isinstance(args[1], torch.Tensor):
            target = torch.device("cpu") if args[1] in self.host else DEVICE
            rest = {"dtype": args[1].dtype}
        else:
            target, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
            rest = {k: v for k, v in (("dtype", dtype), ("memory_format", memory_format)) if v is not None}
            if non_blocking:
                rest["non_blocking"] = True
        out = t.to(**rest) if rest else t  # the real op: the CPU tensor in its new dtype
        src_host = t in self.host
        dst_host = src_host if target is None else not _is_cuda(target)
        file, line = _caller()
        if dst_host and not src_host and not file.startswith(_OURS):
            return out  # megatron-core's own host copies are its business
        if dst_host != src_host and out is t:
            out = t.clone()  # a copy to another device is a new tensor
        if dst_host and out is not t:
            self.host[out] = self.host.get(t, f"{os.path.relpath(file, _ROOT)}:{line} (to the host)")
        return out


def _in_index(t: torch.Tensor, args) -> bool:
    """Whether `t` is (part of) the index of a __getitem__ / __setitem__ call."""
    return len(args) > 1 and any(x is t for x in _tensors(args[1], []))


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
