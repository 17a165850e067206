"""Backend interface (`LogprobOps`) and the `backend=` choice: "triton", "torch" or "auto".

"auto" picks the Triton kernels for CUDA tensors, and on CPU the torch backend unless the Triton interpreter
is enabled (TRITON_INTERPRET=1, read through `triton.knobs.runtime.interpret`). Triton is imported lazily, so
the torch backend works where Triton is not installed.

Shape legend: N tokens, V vocab columns of this shard (or chunk), B sequences; `_B1` [B + 1].
"""

from __future__ import annotations

import os
import sys
from typing import Protocol

import torch

from megatron_gspo.kernels.triton_version import triton_problem

BACKENDS = ("auto", "triton", "torch")


class LogprobOps(Protocol):
    """The three primitives the autograd functions are written against."""

    name: str

    def row_stats(
        self,
        logits_NV: torch.Tensor,
        targets_N: torch.Tensor,
        active_N: torch.Tensor,
        vocab_start: int,
        inv_temperature: float,
        overwrite: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(lse of logits/T, owned target logit/T) per row, fp32 [N] each, 0 for inactive rows."""
        ...

    def dlogits(
        self,
        logits_NV: torch.Tensor,
        targets_N: torch.Tensor,
        grad_N: torch.Tensor,
        lse_N: torch.Tensor,
        vocab_start: int,
        inv_temperature: float,
        out_NV: torch.Tensor,
    ) -> None:
        """Writes grad * (onehot - exp(logits/T - lse)) / T into out_NV (which may alias logits_NV)."""
        ...

    def segment_sums(
        self, values_N: torch.Tensor, active_N: torch.Tensor, cu_seqlens_B1: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of active values fp32 [B], count of active tokens int64 [B]) per sequence."""
        ...


def triton_interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1); False without Triton.

    With a Triton too old for the kernels (no `triton.knobs`) the environment variable answers, so that
    `backend="auto"` still reaches `resolve_backend`'s Triton import, which names the fix.
    """
    if "triton" not in sys.modules and not os.environ.get("TRITON_INTERPRET"):
        return False  # answered without importing triton
    try:
        import triton
    except ImportError:
        return False
    if triton_problem(triton) is not None:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return bool(triton.knobs.runtime.interpret)


def resolve_backend(backend: str, device: torch.device) -> LogprobOps:
    """The ops for `backend` on `device`; a ValueError names the fix when the choice cannot run there."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" or triton_interpreter_enabled() else "torch"
    if backend == "torch":
        from megatron_gspo.kernels.torch_logprob import TorchLogprobOps

        return TorchLogprobOps()
    if device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(
            f"backend='triton' on {device.type} tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1, or use backend='torch' / 'auto'"
        )
    try:
        from megatron_gspo.kernels.triton_logprob import TritonLogprobOps
    except ImportError as err:
        raise ValueError(f"backend='triton': {err}") from err
    return TritonLogprobOps()
