"""A checkpoint written by one layer spec loads into the other (CPU host <-> GPU cluster), strictly.

The TE spec cannot be built on a CPU, so its checkpoint layout is constructed from megatron-core 0.16.1's source
(`models/gpt/gpt_layer_specs.py`, `extensions/transformer_engine.py`) out of the local model's sharded state dict:
  - the TE MoE layer keeps its pre-MLP norm as a separate TENorm without a key remap: `pre_mlp_layernorm.weight`,
    where the local spec's `sharded_state_dict_keys_map` writes `mlp.linear_fc1.layer_norm_weight`;
  - TEDotProductAttention is a TE module with FP8 metadata: `self_attention.core_attention._extra_state`, which the
    local DotProductAttention (no parameters, no extra state) lacks.
Everything else is named alike by both specs (the fused input norm `self_attention.linear_qkv.layer_norm_weight`,
qk norms, router, the `experts.experts.linear_fc1/fc2` keys TEGroupedMLP shares with SequentialMLP, the linear
layers' `_extra_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tests.distributed import run_distributed

LOCAL_NORM = "mlp.linear_fc1.layer_norm_weight"
TE_NORM = "pre_mlp_layernorm.weight"


def _te_shaped(original):
    """model_sharded_state_dict as a TE-spec model would request / write it."""

    def sharded(chunks):
        sd = original(chunks)
        for name, item in list(sd.items()):
            if item.key.endswith("." + LOCAL_NORM):
                item.key = item.key[: -len(LOCAL_NORM)] + TE_NORM
            if name.endswith("self_attention.linear_proj._extra_state"):  # one per layer, same layer sharding
                core = name.replace("linear_proj._extra_state", "core_attention._extra_state")
                sd[core] = dataclasses.replace(
                    item, key=item.key.replace("linear_proj", "core_attention"), data=torch.arange(8, dtype=torch.uint8)
                )
        return sd

    return sharded


@contextlib.contextmanager
def _as_te_spec():
    from megatron_gspo.checkpoint import model_io

    original = model_io.model_sharded_state_dict
    model_io.model_sharded_state_dict = _te_shaped(original)
    try:
        yield
    finally:
        model_io.model_sharded_state_dict = original


def both_directions(work: str) -> dict:
    from megatron_gspo.checkpoint.model_io import _stored_keys, load_model_checkpoint, save_model_checkpoint
    from megatron_gspo.models.build import build_model
    from megatron_gspo.models.hf_state import export_hf_state_dict, load_hf_state_dict
    from megatron_gspo.parallel import ParallelConfig, initialize, shutdown
    from tests.models.parity import hf_state_dict, tiny_config

    cfg, parallel = tiny_config(), ParallelConfig()
    initialize(parallel, seed=3)
    try:
        src = build_model(cfg, parallel)
        load_hf_state_dict(src, hf_state_dict(cfg))
        with torch.no_grad():  # norms are 1.0 at any init: make them tell a loaded value from a fresh one
            for name, p in src[0].named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        out = {"expected": export_hf_state_dict(src)}
        with _as_te_spec():
            save_model_checkpoint(src, f"{work}/te", cfg)
        save_model_checkpoint(src, f"{work}/local", cfg)
        out["stored_te"] = _stored_keys(f"{work}/te/model")
        out["stored_local"] = _stored_keys(f"{work}/local/model")

        fresh = build_model(cfg, parallel)
        out["fresh"] = export_hf_state_dict(fresh)
        load_model_checkpoint(fresh, f"{work}/te")  # TE checkpoint -> local model
        out["te_into_local"] = export_hf_state_dict(fresh)

        fresh = build_model(cfg, parallel)
        with _as_te_spec():
            load_model_checkpoint(fresh, f"{work}/local")  # local checkpoint -> TE key layout
        out["local_into_te"] = export_hf_state_dict(fresh)
        return out
    finally:
        shutdown()


def test_checkpoints_load_across_layer_specs(tmp_path):
    out = run_distributed(both_directions, str(tmp_path), world_size=1)[0]
    te, local = out["stored_te"], out["stored_local"]
    assert "decoder.layers." + TE_NORM in te and "decoder.layers." + LOCAL_NORM not in te
    assert "decoder.layers.self_attention.core_attention._extra_state" in te
    assert "decoder.layers." + LOCAL_NORM in local and "decoder.layers." + TE_NORM not in local
    expected = out["expected"]
    norm = "model.layers.2.post_attention_layernorm.weight"
    assert not torch.equal(out["fresh"][norm], expected[norm])
    for direction in ("te_into_local", "local_into_te"):
        assert set(out[direction]) == set(expected)
        for key, value in expected.items():
            assert torch.equal(out[direction][key], value), f"{direction}: {key}"
