"""Memory model: sanity and monotonicity of the per-GPU estimate."""

from __future__ import annotations

import pytest

from megatron_gspo.models.config import preset
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.planning.layouts import Cluster, plan_layout
from megatron_gspo.planning.memory import (
    GiB,
    Layout,
    MemoryAssumptions,
    Workload,
    estimate_memory,
    estimate_stage_memory,
    inflight_microbatches,
    layer_activation_bytes,
    padded_vocab,
    stage_parameters,
)
from megatron_gspo.planning.params import count_parameters

QWEN = preset("qwen3-30b-a3b")
WORK = Workload(seq_len=8192, micro_batch_size=1, global_batch_size=256)


def test_padded_vocab():
    assert padded_vocab(151936, 1) == 151936
    assert padded_vocab(151936, 8) == 152576
    assert padded_vocab(32, 2) == 256


def test_stage_params_partition_the_model():
    layout = Layout(tp=1, pp=4, ep=8, etp=1, dp=8)
    parts = [stage_parameters(QWEN, layout, s) for s in range(layout.pp)]
    dense = sum(d for d, _ in parts)
    expert = sum(e for _, e in parts) * layout.ep
    assert dense + expert == count_parameters(QWEN).total
    assert parts[0][0] > parts[1][0] and parts[-1][0] > parts[1][0]  # embedding / LM head stages


def test_more_tp_less_weight_memory():
    weights = [estimate_memory(QWEN, Layout(tp=t, ep=8, dp=64 // t), WORK).weights for t in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == 4


def test_more_ep_less_expert_memory_and_more_dp_less_optimizer():
    experts = [estimate_memory(QWEN, Layout(ep=e, dp=16), WORK).expert_params for e in (1, 2, 4, 8, 16)]
    assert experts == sorted(experts, reverse=True)
    opt = [estimate_memory(QWEN, Layout(ep=8, dp=d), WORK).optimizer for d in (8, 16, 32)]
    assert opt == sorted(opt, reverse=True)


def test_fused_logits_below_naive():
    m = estimate_memory(QWEN, Layout(ep=8, dp=8), WORK)
    assert 0 < m.logits_fused < m.logits_naive
    assert m.logits == m.logits_fused
    naive = estimate_memory(QWEN, Layout(ep=8, dp=8), Workload(seq_len=8192, logprob="naive"))
    assert naive.logits == naive.logits_naive and naive.total > m.total
    # [T, V] fp32-sized: 8192 x 151936 x 12 bytes.
    assert m.logits_naive == 12 * 8192 * 151936


def test_recompute_ordering():
    acts = {
        r: estimate_memory(QWEN, Layout(ep=8, dp=8), Workload(seq_len=8192, recompute=r)).activations
        for r in ("none", "selective", "full")
    }
    assert acts["full"] < acts["selective"] < acts["none"]
    full_layer = layer_activation_bytes(QWEN, Layout(tp=2, dp=4), WORK, "full")
    assert full_layer == {"layer_input": 2 * 8192 / 2 * 2048}
    none = layer_activation_bytes(QWEN, Layout(), WORK, "none")
    selective = layer_activation_bytes(QWEN, Layout(), WORK, "selective")
    assert set(none) - set(selective) == {"swiglu_output"}


def test_selective_recompute_is_what_the_trainer_asks_megatron_for():
    """The planner's "selective" drops what the trainer's recompute_modules drop on the TE spec (it assumed
    "layernorm" too, which the trainer never sets: the norm outputs were missing from its activations)."""
    from megatron_gspo.models.build import selective_recompute_modules
    from megatron_gspo.planning.memory import SELECTIVE_RECOMPUTE_MODULES

    assert list(SELECTIVE_RECOMPUTE_MODULES) == selective_recompute_modules(use_te=True)


def test_activations_scale_with_tokens_and_split_with_tp_cp():
    base = sum(layer_activation_bytes(QWEN, Layout(), WORK, "none").values())
    double = sum(layer_activation_bytes(QWEN, Layout(), Workload(seq_len=16384), "none").values())
    assert double == pytest.approx(2 * base)
    tp2 = sum(layer_activation_bytes(QWEN, Layout(tp=2), WORK, "none").values())
    cp2 = sum(layer_activation_bytes(QWEN, Layout(cp=2), WORK, "none").values())
    assert tp2 == pytest.approx(base / 2, rel=0.15) and cp2 == pytest.approx(base / 2)


def test_pipeline_inflight_microbatches():
    layout = Layout(pp=4, ep=8, dp=8)
    assert [inflight_microbatches(layout, WORK, s) for s in range(4)] == [4, 3, 2, 1]
    few = Workload(global_batch_size=16)  # 2 micro-batches per rank
    assert inflight_microbatches(layout, few, 0) == 2
    stage0 = estimate_stage_memory(QWEN, layout, WORK, 0)
    last = estimate_stage_memory(QWEN, layout, WORK, 3)
    assert stage0.logits == 0 and last.logits > 0
    assert estimate_memory(QWEN, layout, WORK).total == max(stage0.total, last.total, *(
        estimate_stage_memory(QWEN, layout, WORK, s).total for s in (1, 2)))


def test_routing_replay_storage():
    off = estimate_memory(QWEN, Layout(ep=8, dp=8), WORK)
    r2 = estimate_memory(QWEN, Layout(ep=8, dp=8), Workload(seq_len=8192, routing_replay="r2"))
    assert off.routing_replay == 0 < r2.routing_replay
    # uint8 ids for the rollout batch: 4*256 sequences / dp 8 x 8192 tokens x 48 layers x top-8, plus int64 in flight.
    cache = 1024 / 8 * 8192 * 48 * 8
    assert r2.routing_replay == pytest.approx(cache + 8192 * 48 * 8 * 8)
    wide = preset("qwen3-30b-a3b", num_experts=512)
    r2_wide = estimate_memory(wide, Layout(ep=8, dp=8), Workload(seq_len=8192, routing_replay="r2"))
    assert r2_wide.routing_replay == pytest.approx(2 * cache + 8192 * 48 * 8 * 8)


def test_overhead_is_counted():
    a = estimate_memory(QWEN, Layout(ep=8, dp=8), WORK, MemoryAssumptions(overhead_gib=3))
    b = estimate_memory(QWEN, Layout(ep=8, dp=8), WORK, MemoryAssumptions(overhead_gib=5))
    assert b.total - a.total == pytest.approx(2 * GiB)


def test_30b_does_not_fit_one_80gb_gpu():
    plan = plan_layout(QWEN, ParallelConfig(), Cluster(1, 1, 80.0), WORK)
    assert not plan.fits and plan.headroom_gib < 0
    # bf16 weights + fp32 grads + fp32 master and Adam m, v alone: (2 + 4 + 12) bytes x 30.5B.
    assert plan.memory.weights + plan.memory.grads + plan.memory.optimizer == pytest.approx(18 * 30_532_122_624)


def test_tiny_fits_anywhere():
    plan = plan_layout(preset("tiny"), ParallelConfig(), Cluster(1, 1, 1.0), Workload(seq_len=256),
                       MemoryAssumptions(overhead_gib=0.5))
    assert plan.fits


@pytest.mark.parametrize("field,value", [("recompute", "some"), ("routing_replay", "r4"), ("seq_len", 0)])
def test_workload_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        Workload(**{field: value})
