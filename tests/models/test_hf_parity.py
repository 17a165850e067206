"""Single-process parity with transformers' Qwen3MoeForCausalLM (random weights built locally)."""

import torch

from tests.distributed import run_distributed
from tests.models.parity import hf_state_dict, tiny_config


def _megatron_logits(overrides: dict, ids: torch.Tensor) -> torch.Tensor:
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown

    cfg = tiny_config(**overrides)
    parallel = ParallelConfig()
    initialize(parallel, seed=3)
    try:
        model = build_model(cfg, parallel)[0].eval()
        load_hf_state_dict(model, hf_state_dict(cfg))
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
        with torch.no_grad():
            return model(ids, pos, None)[..., : cfg.vocab_size]
    finally:
        shutdown()


def _hf_logits(overrides: dict, ids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3MoeForCausalLM

    cfg = tiny_config(**overrides)
    model = Qwen3MoeForCausalLM(cfg.to_hf_config()).float().eval()
    model.load_state_dict(hf_state_dict(cfg))
    with torch.no_grad():
        return model(ids).logits


def _check(overrides: dict):
    cfg = tiny_config(**overrides)
    ids = torch.randint(0, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(5))
    ours = run_distributed(_megatron_logits, overrides, ids, world_size=1)[0]
    ref = _hf_logits(overrides, ids)
    assert ours.shape == ref.shape
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tiny_preset_matches_transformers():
    _check({})


def test_odd_shapes_match_transformers():
    # head_dim != hidden / heads, a single KV head, a vocab that is no multiple of 128, no top-k renormalisation.
    _check(dict(head_dim=24, num_key_value_heads=1, vocab_size=37, norm_topk_prob=False, num_experts=6))
