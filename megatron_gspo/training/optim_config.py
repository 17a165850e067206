"""Optimizer settings (megatron's AdamW / SGD)."""

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
        if self.clip_grad < 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError("optim.clip_grad, optim.weight_decay and optim.warmup_steps must be >= 0")
