"""Qwen3-MoE on megatron-core: config + presets (no megatron import), and (lazily) the model builder and the
HF <-> Megatron tensor mapping."""

from megatron_gspo.models.config import PRESETS, ModelConfig, preset

__all__ = ["PRESETS", "ModelConfig", "preset"]
