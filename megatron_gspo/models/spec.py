"""Megatron-Core layer specs for Qwen3-MoE: TE spec on GPU when transformer-engine imports, local spec otherwise."""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_gspo.models.attention import PackedDotProductAttention
from megatron_gspo.models.experts import ExpertLoop
from megatron_gspo.models.norm import RMSNorm
from megatron_gspo.models.router import MicroBatchMeanAuxRouter

TE_IMPORT_ERROR: str | None = None
"""Why transformer-engine did not import ('ModuleNotFoundError: ...' when it is not installed); None when it did."""
try:  # transformer-engine is a GPU-only extra
    import transformer_engine  # noqa: F401
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    HAVE_TE = True
except Exception as _err:  # noqa: BLE001 - any import failure means "no TE"; build.py reports it on a GPU
    HAVE_TE = False
    TE_IMPORT_ERROR = f"{type(_err).__name__}: {_err}"


def _with_local_modules(layer_spec: ModuleSpec) -> ModuleSpec:
    """Swaps the local spec's torch norms for our sequence-parallel-capable RMSNorm, its core attention for one
    that also runs packed (THD) sequences (models/attention.py) and its SequentialMLP experts for the same experts
    without the per-expert module calls (models/experts.py)."""
    sub = layer_spec.submodules
    experts = sub.mlp.submodules.experts
    sub = dataclasses.replace(
        sub,
        mlp=dataclasses.replace(
            sub.mlp,
            submodules=dataclasses.replace(
                sub.mlp.submodules, experts=dataclasses.replace(experts, module=ExpertLoop)
            ),
        ),
    )
    attn = sub.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm, core_attention=PackedDotProductAttention
    )
    new_attn = ModuleSpec(module=attn.module, params=attn.params, submodules=attn_sub)
    new_sub = dataclasses.replace(sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=new_attn)
    return ModuleSpec(module=layer_spec.module, params=layer_spec.params, submodules=new_sub)


def _with_router(layer_spec: ModuleSpec) -> ModuleSpec:
    """Puts our router (load-balancing loss weighted per micro-batch, models/router.py) into the MoE layer."""
    sub = layer_spec.submodules
    mlp = dataclasses.replace(sub.mlp, submodules=dataclasses.replace(sub.mlp.submodules, router=MicroBatchMeanAuxRouter))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, mlp=mlp))


def qwen3_moe_block_spec(num_experts: int, num_local_layers: int, use_te: bool) -> TransformerBlockSubmodules:
    """Decoder block spec with `num_local_layers` identical MoE layers (every Qwen3-MoE layer is MoE)."""
    if use_te:
        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True, qk_layernorm=True
        )
        final_norm = TENorm
    else:
        layer = _with_local_modules(
            get_gpt_layer_local_spec(
                num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
            )
        )
        final_norm = RMSNorm
    layer = _with_router(layer)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=final_norm)
