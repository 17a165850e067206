"""Qwen3-MoE model configuration with Hugging Face field names, and named presets.

The one place a Megatron `TransformerConfig` is derived from it is `models/build.py`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    """Architecture of a Qwen3-MoE model (field names as in transformers' `Qwen3MoeConfig`)."""

    vocab_size: int = 151936
    """Number of token ids (unpadded; Megatron pads the embedding for TP)."""
    hidden_size: int = 2048
    """Residual stream width."""
    num_hidden_layers: int = 48
    """Transformer layers (every layer is MoE in Qwen3-MoE)."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 4
    """KV heads (grouped-query attention)."""
    head_dim: int = 128
    """Per-head width; may differ from hidden_size / num_attention_heads."""
    num_experts: int = 128
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 8
    """Top-k experts per token."""
    moe_intermediate_size: int = 768
    """FFN width of one expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (also for the q/k norms)."""
    max_position_embeddings: int = 40960
    """Longest supported sequence."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the LM head."""
    router_aux_loss_coef: float = 0.001
    """Load-balancing auxiliary loss coefficient (0 disables it)."""

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds model.num_experts={self.num_experts}"
            )
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("model.rope_theta and model.rms_norm_eps must be > 0")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"model.router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")

    # ---- conversions -------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Any) -> ModelConfig:
        """From a transformers `Qwen3MoeConfig`, a config.json path / directory, or a plain dict."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no Hugging Face config at {path}")
            config = json.loads(path.read_text())
        data = config if isinstance(config, dict) else config.to_dict()
        arch = data.get("model_type")
        if arch is not None and arch != "qwen3_moe":
            raise ValueError(f"{arch!r} checkpoints are not supported: model_type must be 'qwen3_moe'")
        extra_dense = data.get("mlp_only_layers") or []
        if extra_dense:
            raise ValueError(f"mlp_only_layers={extra_dense} (dense layers) are not supported: every layer must be MoE")
        if data.get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"decoder_sparse_step={data['decoder_sparse_step']} is not supported: it must be 1")
        if "num_experts" not in data and "num_local_experts" in data:
            # transformers 5 serialises Qwen3MoeConfig.num_experts as num_local_experts
            data = {**data, "num_experts": data["num_local_experts"]}
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        if "head_dim" not in kwargs:
            kwargs["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if "rope_theta" not in kwargs and isinstance(rope, dict) and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json body that transformers' `Qwen3MoeConfig` accepts."""
        data = asdict(self)
        data.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_act="silu",
            intermediate_size=self.moe_intermediate_size * self.num_experts_per_tok,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attention_bias=False,
            attention_dropout=0.0,
            output_router_logits=False,
            torch_dtype="bfloat16",
        )
        return data

    def to_hf_config(self):
        """A transformers `Qwen3MoeConfig` (the parity oracle builds random models from it locally)."""
        from transformers import Qwen3MoeConfig

        data = self.to_hf_dict()
        data.pop("architectures")
        data.pop("model_type")
        return Qwen3MoeConfig(**data)

    # ---- counts ---------------------------------------------------------------------------------------------
    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token) parameter counts of the HF model (embedding and LM head included)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_attention_heads * 2 + self.num_key_value_heads * 2) + 2 * hd
        expert = 3 * h * self.moe_intermediate_size
        router = h * self.num_experts
        norms = 2 * h
        per_layer_total = attn + router + norms + self.num_experts * expert
        per_layer_active = attn + router + norms + self.num_experts_per_tok * expert
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        outer = embed + head + h
        return (
            outer + self.num_hidden_layers * per_layer_total,
            outer + self.num_hidden_layers * per_layer_active,
        )


PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized Qwen3-MoE shape: a few layers, 8 experts top-2, GQA, qk-norm (REFERENCE.md §8).
    "tiny": dict(
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        rope_theta=10000.0,
        max_position_embeddings=256,
        router_aux_loss_coef=0.0,
    ),
    # The MoE stability benchmark's CPU model (examples/stability_moe.yaml): tiny's widths with 6 MoE layers of 64
    # experts top-8 and Qwen3's aux-loss coefficient. Chosen by the drift sweep (README, tools/drift_sweep.py):
    # the most expert drift per update among the CPU-sized shapes measured while RL still trains.
    "tiny-moe64": dict(
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=32,
        rope_theta=10000.0,
        max_position_embeddings=256,
        router_aux_loss_coef=0.001,
    ),
    # REFERENCE.md §3.
    "qwen3-30b-a3b": dict(),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named model preset with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is unknown; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
