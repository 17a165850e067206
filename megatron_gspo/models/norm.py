"""RMSNorm for megatron-core's local (non-TE) layer spec that also works with sequence parallelism.

megatron-core's `WrappedTorchNorm` refuses `sequence_parallel`; TE's norm supports it but needs CUDA. Under
sequence parallelism each TP rank normalises a different slice of tokens, so the norm weight's gradient is a
partial sum: marking the parameter `sequence_parallel=True` makes megatron's `finalize_model_grads` all-reduce it
across the TP group. This is a spec module (ModuleSpec / build_module), not a patch.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (Qwen3: model norms and per-head q/k norms)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Read by finalize_model_grads: all-reduce this grad over TP when activations are sequence-split.
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.float()
        y = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)
