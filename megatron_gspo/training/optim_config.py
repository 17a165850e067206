"""Optimizer settings (megatron's AdamW / SGD) and how its state and the gradient reduction are distributed."""

from __future__ import annotations

import math
from dataclasses import dataclass

_FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class OptimConfig:
    """Optimizer settings (AdamW through megatron's optimizer)."""

    optimizer: str = "adam"
    """adam (AdamW: decoupled weight decay) or sgd."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the schedule."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.99
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    warmup_steps: int = 0
    """Linear warm-up in optimizer steps."""
    distributed: bool = True
    """megatron's DistributedOptimizer (ZeRO-1): fp32 master weights, Adam moments and the optimizer step are
    sharded over data-parallel replicas (gradients reduce-scattered, updated params all-gathered), instead of
    replicated on every rank. Adam only."""
    overlap_grad_reduce: bool = False
    """Reduce gradients bucket by bucket while the backward pass runs (megatron DDP; worth it on GPU)."""
    overlap_param_gather: bool = False
    """All-gather updated params bucket by bucket during the next forward (needs `distributed` and
    `overlap_grad_reduce`); the trainer forces the gather to completion before weights leave the model."""
    bucket_size: int | None = None
    """Elements per gradient bucket with `overlap_grad_reduce` (None: megatron's max(4e7, 1e6 * DP))."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optim.optimizer={self.optimizer!r} must be adam or sgd")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optim.lr={self.lr} must be a finite number > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be in [0, 1)")
        # Adam's first step moves a parameter by lr / (1 - beta1) (bias correction): it must be a float32 number.
        if self.optimizer == "adam" and self.lr / (1 - self.beta1) >= _FLOAT32_MAX:
            raise ValueError(
                f"optim.lr={self.lr:g} overflows float32 in Adam's first step (lr / (1 - beta1) = "
                f"{self.lr / (1 - self.beta1):.3g} > {_FLOAT32_MAX:.3g})"
            )
        if self.distributed and self.optimizer != "adam":
            raise ValueError(
                f"optim.optimizer={self.optimizer} needs optim.distributed=false: megatron's distributed optimizer "
                "supports adam only"
            )
        if self.overlap_param_gather and not (self.distributed and self.overlap_grad_reduce):
            raise ValueError("optim.overlap_param_gather=true needs optim.distributed=true and optim.overlap_grad_reduce=true")
        if self.bucket_size is not None and (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int)
                                             or self.bucket_size < 1):
            raise ValueError(f"optim.bucket_size={self.bucket_size!r} must be a number of elements >= 1 (or null)")
        if self.clip_grad < 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError("optim.clip_grad, optim.weight_decay and optim.warmup_steps must be >= 0")
