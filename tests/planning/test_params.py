"""Parameter counts: exact against the transformers model's numel; Qwen3-30B-A3B against the published figures."""

from __future__ import annotations

import math

import pytest

from megatron_gspo.models.config import preset
from megatron_gspo.planning.params import count_parameters, format_count

VARIANTS = {
    "tiny": {},
    "tiny-tied": {"tie_word_embeddings": True},
    "tiny-headdim-kv1": {"head_dim": 48, "num_key_value_heads": 1, "vocab_size": 50},
}


@pytest.fixture(scope="module")
def hf_models():
    transformers = pytest.importorskip("transformers")
    models = {}
    for name, overrides in VARIANTS.items():
        cfg = preset("tiny", **overrides)
        models[name] = (cfg, transformers.Qwen3MoeForCausalLM(cfg.to_hf_config()))
    return models


@pytest.mark.parametrize("name", list(VARIANTS))
def test_total_equals_transformers_numel(hf_models, name):
    cfg, model = hf_models[name]
    numel = sum(p.numel() for p in model.parameters())
    counts = count_parameters(cfg)
    assert counts.total == numel
    assert cfg.num_parameters() == (counts.total, counts.active)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_components_and_active_match_the_modules(hf_models, name):
    cfg, model = hf_models[name]
    counts = count_parameters(cfg)
    by_name = dict(model.named_parameters())
    expert = sum(p.numel() for n, p in by_name.items() if ".mlp.experts." in n)
    router = sum(p.numel() for n, p in by_name.items() if n.endswith(".mlp.gate.weight"))
    attn = sum(p.numel() for n, p in by_name.items() if ".self_attn." in n and "_norm" not in n)
    assert expert == counts.expert_total
    assert router == cfg.num_hidden_layers * counts.router
    assert attn == cfg.num_hidden_layers * counts.attention
    assert by_name["model.embed_tokens.weight"].numel() == counts.embedding
    # Active: everything but the experts, plus top-k / E of the expert weights.
    numel = sum(p.numel() for p in model.parameters())
    top_k = cfg.num_experts_per_tok / cfg.num_experts
    assert counts.active == numel - expert + expert * top_k
    assert counts.non_embedding == numel - counts.embedding - counts.lm_head


def test_qwen3_30b_a3b_published_figures():
    counts = count_parameters(preset("qwen3-30b-a3b"))
    # Exact integers, pinned (HF convention: embedding table + LM head counted in full).
    assert counts.total == 30_532_122_624
    assert counts.active == 3_353_032_704
    # Model card: "30.5B in total and 3.3B activated", "Non-Embedding: 29.9B".
    assert abs(counts.total / 30.5e9 - 1) < 0.01
    assert abs(counts.non_embedding / 29.9e9 - 1) < 0.01
    # "3.3B": 3.353B is +1.6%, within 1% of 3.35B and 3.3B once cut to one decimal as on the card (30.53 -> 30.5,
    # 29.91 -> 29.9). The other conventions are further off (params.py docstring).
    assert abs(counts.active / 3.35e9 - 1) < 0.01
    assert math.floor(counts.active / 1e8) / 10 == 3.3
    assert math.floor(counts.total / 1e8) / 10 == 30.5
    assert abs(counts.active_compute / 3.3e9 - 1) > 0.01 and abs(counts.non_embedding_active / 3.3e9 - 1) > 0.01
    assert counts.active_compute == counts.active - counts.embedding


def test_format_count():
    assert format_count(30_532_122_624) == "30.53B"
    assert format_count(1_783_168) == "1.78M"
    assert format_count(12) == "12"
