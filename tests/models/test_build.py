"""Which layer spec and recompute modules a build gets: TE only where it imports, a named warning on a CUDA machine
whose TE import fails, and `recompute: selective` valid for the spec in use (megatron's TransformerConfig rejects
`moe_act` without grouped-GEMM experts)."""

import logging

import pytest
import torch

from megatron_gspo.models import spec
from megatron_gspo.models.build import (
    BuildOptions,
    resolve_use_te,
    selective_recompute_modules,
    transformer_config,
)
from megatron_gspo.models.config import preset
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.training.config import load_run_config

BROKEN = "ImportError: libtransformer_engine.so: undefined symbol: _ZN3c104cuda9SetDevice"


@pytest.fixture()
def cuda_machine_with_broken_te(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(spec, "HAVE_TE", False)
    monkeypatch.setattr(spec, "TE_IMPORT_ERROR", BROKEN)


def test_this_machine_records_why_te_does_not_import():
    if spec.HAVE_TE:
        assert spec.TE_IMPORT_ERROR is None
    else:
        assert spec.TE_IMPORT_ERROR and spec.TE_IMPORT_ERROR.split(":")[0] in ("ModuleNotFoundError", "ImportError")


def test_a_cuda_machine_without_te_warns_with_the_import_error(cuda_machine_with_broken_te, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.models.build"):
        assert resolve_use_te(BuildOptions()) is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert BROKEN in warnings[0] and "local layer spec" in warnings[0] and "model.use_te=false" in warnings[0]


def test_choosing_the_local_spec_is_silent_and_asking_for_te_names_the_error(cuda_machine_with_broken_te, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_use_te(BuildOptions(use_te=False)) is False
    assert not caplog.records
    with pytest.raises(ValueError, match=r"model\.use_te=true but transformer-engine does not import \(ImportError"):
        resolve_use_te(BuildOptions(use_te=True))


def test_no_cuda_means_the_local_spec_without_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert resolve_use_te(BuildOptions()) is False
    assert not caplog.records


def test_use_te_is_a_run_config_key():
    assert load_run_config("examples/tiny_moe_gspo.yaml", ["model.use_te=false"]).model.use_te is False
    assert load_run_config("examples/tiny_moe_gspo.yaml").model.use_te is None
    with pytest.raises(ValueError, match=r"model\.use_te='maybe' must be true or false"):
        load_run_config("examples/tiny_moe_gspo.yaml", ["model.use_te=maybe"])


def test_selective_recompute_modules_follow_the_spec():
    # TE: no core-attention recompute (its fused attention keeps no [s, s] matrix; megatron warns it is pointless).
    assert selective_recompute_modules(use_te=True) == ["moe_act"]
    assert selective_recompute_modules(use_te=False) == ["core_attn"]


LOCAL_FUSIONS = dict(apply_rope_fusion=False, moe_permute_fusion=False, bias_activation_fusion=False,
                     gradient_accumulation_fusion=False, moe_router_fusion=False, masked_softmax_fusion=False)


@pytest.fixture
def pretend_te(monkeypatch):
    """megatron's TransformerConfig as with transformer-engine installed, as far as its validation looks: the
    fused RoPE / permutation functions it checks for exist (stand-ins; nothing here runs them)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None, raising=False)
    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, lambda *a, **k: None, raising=False)  # defined only with TE


@pytest.mark.parametrize("apex_wgrad", [True, False])
def test_te_spec_config_turns_the_fusions_on(pretend_te, monkeypatch, apex_wgrad):
    """With TE: fused RoPE (no per-layer host sync of cu_seqlens for THD), fused MoE permutation, fused SwiGLU,
    and gradient-accumulation fusion when apex's wgrad extension imports (megatron's output layer refuses it
    otherwise); router fusion stays off (it bypasses routing replay); selective recompute without core_attn."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if apex_wgrad else None)
                        if name == "fused_weight_gradient_mlp_cuda" else find_spec(name, *a))
    cfg = transformer_config(preset("tiny"), ParallelConfig(), BuildOptions(recompute="selective", use_te=True),
                             use_te=True)
    assert cfg.apply_rope_fusion and cfg.moe_permute_fusion and cfg.bias_activation_fusion
    assert cfg.gradient_accumulation_fusion is apex_wgrad
    assert not cfg.moe_router_fusion and cfg.moe_grouped_gemm
    assert cfg.recompute_modules == ["moe_act"]


def test_local_spec_config_keeps_every_fusion_off():
    cfg = transformer_config(preset("tiny"), ParallelConfig(), BuildOptions(use_te=False), use_te=False)
    assert {k: getattr(cfg, k) for k in LOCAL_FUSIONS} == LOCAL_FUSIONS


def test_selective_recompute_builds_a_local_spec_config():
    """The TransformerConfig megatron validates (it raised 'moe_act in recompute_modules is only supported with
    moe_grouped_gemm' for the local spec before)."""
    cfg = transformer_config(preset("tiny"), ParallelConfig(), BuildOptions(recompute="selective", use_te=False))
    assert cfg.recompute_granularity == "selective" and cfg.recompute_modules == ["core_attn"]
    assert cfg.moe_grouped_gemm is False
    assert cfg.calculate_per_token_loss is True  # set before any router caches it (models/router.py)


def _with_and_without_selective_recompute():
    from tests.models.parity import run_layout

    aux = {"router_aux_loss_coef": 0.1}
    return run_layout({}, aux, "none"), run_layout({}, aux, "selective")


def test_selective_recompute_trains_like_no_recompute():
    """Two SGD steps with core-attention recompute (the local spec's selective set) equal those without."""
    from tests.distributed import run_distributed

    plain, selective = run_distributed(_with_and_without_selective_recompute, world_size=1)[0]
    torch.testing.assert_close(selective["loss"], plain["loss"], rtol=0, atol=1e-6)
    for key, value in plain["grads"].items():
        assert value.abs().max() > 0, key
        torch.testing.assert_close(selective["grads"][key], value, rtol=1e-5, atol=1e-7, msg=key)
    for key, value in plain["weights"].items():
        torch.testing.assert_close(selective["weights"][key], value, rtol=1e-5, atol=1e-7, msg=key)
