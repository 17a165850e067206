"""Layout validation (errors name the key), the step proxy's placement rules, and layout suggestions."""

from __future__ import annotations

import pytest

from megatron_gspo.models.config import ModelConfig, preset
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.planning.layouts import (
    Cluster,
    LayoutError,
    candidate_layouts,
    plan_layout,
    suggest_layouts,
    validate_layout,
)
from megatron_gspo.planning.memory import Layout, Workload

QWEN = preset("qwen3-30b-a3b")
WORK = Workload(seq_len=8192)
TWO_NODES = Cluster(2, 8, 80.0)


def test_valid_layout_gives_dp():
    layout = validate_layout(QWEN, ParallelConfig(tp=2, pp=2, ep=8, sequence_parallel=True), TWO_NODES)
    assert (layout.tp, layout.pp, layout.ep, layout.etp, layout.dp) == (2, 2, 8, 1, 4)
    assert layout.expert_dp == 1 and layout.world_size == 16


@pytest.mark.parametrize(
    "parallel,key",
    [
        (dict(tp=3, sequence_parallel=True), "parallel.tp=3 does not divide model.num_attention_heads=32"),
        (dict(ep=5), "parallel.ep=5 does not divide model.num_experts=128"),
        (dict(pp=5), "parallel.pp=5 does not divide model.num_hidden_layers=48"),
        (dict(pp=32), "parallel.pp=32 does not divide model.num_hidden_layers=48"),
        (dict(tp=2), "parallel.sequence_parallel"),
        (dict(ep=32), "parallel.ep*etp=32*1 does not divide world_size/pp=16"),
        (dict(ep=2, etp=5), "parallel.etp=5 does not divide model.moe_intermediate_size=768"),
        (dict(pp=2, virtual_pp=5), "parallel.virtual_pp=5"),
        (dict(pp=3), "parallel.tp*pp*cp=1*3*1=3 does not divide the world size 16"),  # cp > 1 is refused earlier
    ],
)
def test_invalid_layout_names_the_key(parallel, key):
    with pytest.raises(LayoutError) as info:
        validate_layout(QWEN, ParallelConfig(**parallel), TWO_NODES)
    assert any(key in p for p in info.value.problems), info.value.problems
    assert isinstance(info.value, ValueError)


def test_kv_heads_rule():
    model = ModelConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=384, head_dim=64, num_hidden_layers=2,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=100)
    with pytest.raises(LayoutError, match="model.num_key_value_heads=3"):
        validate_layout(model, ParallelConfig(tp=2, sequence_parallel=True), Cluster(1, 2))
    # tp a multiple of the KV heads is fine (megatron replicates KV heads): 32 q / 4 kv heads with tp=8.
    validate_layout(QWEN, ParallelConfig(tp=8, sequence_parallel=True), TWO_NODES)


def test_all_problems_reported_together():
    with pytest.raises(LayoutError) as info:
        validate_layout(QWEN, ParallelConfig(tp=3, pp=5, ep=5, sequence_parallel=True), TWO_NODES)
    text = str(info.value)
    for key in ("parallel.tp=3", "parallel.pp=5", "parallel.ep=5"):
        assert key in text


def test_global_batch_checked_only_when_asked():
    parallel = ParallelConfig(ep=8)
    work = Workload(global_batch_size=20)
    validate_layout(QWEN, parallel, TWO_NODES, work)
    with pytest.raises(LayoutError, match="trainer.global_batch_size=20"):
        validate_layout(QWEN, parallel, TWO_NODES, work, check_global_batch=True)


def test_invalid_layout_object():
    with pytest.raises(ValueError, match="parallel.ep"):
        Layout(pp=4, ep=8, dp=2)


def test_tp_across_nodes_costs_inter_node_traffic():
    small_nodes = Cluster(4, 4, 80.0)
    intra = plan_layout(QWEN, ParallelConfig(tp=4, ep=4, sequence_parallel=True), small_nodes, WORK)
    inter = plan_layout(QWEN, ParallelConfig(tp=8, ep=2, sequence_parallel=True), small_nodes, WORK)
    assert intra.step.inter_bytes < inter.step.inter_bytes
    ep_in = plan_layout(QWEN, ParallelConfig(ep=8), TWO_NODES, WORK)
    ep_out = plan_layout(QWEN, ParallelConfig(ep=16), TWO_NODES, WORK)
    assert ep_in.step.comm_s < ep_out.step.comm_s


def test_candidates_are_the_documented_grid():
    cands = list(candidate_layouts(QWEN, TWO_NODES))
    assert {c.tp for c in cands} == {1, 2, 4, 8}
    assert {c.pp for c in cands} == {1, 2, 3, 4, 6, 8, 12, 16}
    assert {c.etp for c in cands} == {1} and all(QWEN.num_experts % c.ep == 0 for c in cands)
    assert all(c.sequence_parallel == (c.tp > 1) for c in cands)


def test_suggestions_fit_and_are_ranked():
    plans = suggest_layouts(QWEN, TWO_NODES, WORK, top=5)
    assert len(plans) == 5
    assert all(p.fits for p in plans)
    times = [p.step.step_s for p in plans]
    assert times == sorted(times)
    for p in plans:  # every suggestion passes validation
        validate_layout(QWEN, ParallelConfig(tp=p.layout.tp, pp=p.layout.pp, ep=p.layout.ep, etp=p.layout.etp,
                                             sequence_parallel=p.layout.tp > 1), TWO_NODES)


def test_nothing_fits_one_gpu():
    plans = suggest_layouts(QWEN, Cluster(1, 1, 80.0), WORK)
    assert plans and not any(p.fits for p in plans)
