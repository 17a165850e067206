"""Configuration of the in-process rollout engine (config section `rollout.local`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOCAL_BACKENDS = ("auto", "megatron", "hf")
"""How the in-process engine runs the model (rollout/local/engine.py)."""
ENGINE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Precisions the engine can sample in."""


@dataclass
class LocalEngineConfig:
    """The in-process engine (rollout.engine=local): which implementation samples, in which precision.

    Production RL pairs a bf16 inference engine with a trainer that keeps fp32 master weights; the mismatch between
    the two (R3 paper, arXiv:2510.11370 §3: ~10% of routers choose other experts, train / inference KL 1.5e-3) is
    one of the drivers of GRPO's collapse on MoE models. `dtype` brings that mismatch to a CPU run."""

    backend: str = "auto"
    """megatron: the trainer's own GPTModel samples (engine = trainer, bitwise) | hf: a transformers replica refreshed
    from the trainer's weights at every sync (a second implementation) | auto: megatron unless the model is split
    or `dtype` differs from the trainer's."""
    dtype: str | None = None
    """Precision of the engine: null = the trainer's (model.dtype) | fp32 | bf16 | fp16. A precision other than the
    trainer's samples from the hf replica with the weights rounded to it (the trainer keeps its own)."""

    def __post_init__(self) -> None:
        if self.backend not in LOCAL_BACKENDS:
            raise ValueError(f"rollout.local.backend={self.backend!r} must be one of {', '.join(LOCAL_BACKENDS)}")
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            raise ValueError(
                f"rollout.local.dtype={self.dtype!r} must be null (the trainer's) or one of {', '.join(ENGINE_DTYPES)}"
            )

    def torch_dtype(self) -> torch.dtype | None:
        """The engine's torch dtype, None for the trainer's."""
        return None if self.dtype is None else ENGINE_DTYPES[self.dtype]
