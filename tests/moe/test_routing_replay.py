"""Routing replay on the tiny Qwen3-MoE (4 layers, 8 experts top-2) through megatron's schedule.

One single-process run and one 2-process gloo run (TP=2 + sequence parallel with full recompute, EP=2,
PP=2 with full recompute, in turn) are shared by the tests below. In every case: routes are recorded in a forward-only pass, an SGD step
(lr 1.0) changes the weights, and a router forward hook captures the routing actually used by the next training
forward (and by the recompute inside the backward pass), mapped back to sequences independently of the package.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.moe.replay_ranks import LENGTHS, run_layouts, run_single_process

LAYOUTS = [
    ("tp2_sp", dict(tp=2, sequence_parallel=True), "full"),
    ("ep2", dict(ep=2), "none"),
    ("pp2_recompute", dict(pp=2), "full"),
]


@pytest.fixture(scope="module")
def single():
    return run_distributed(run_single_process, world_size=1)[0]


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(run_layouts, LAYOUTS, world_size=2)


def test_recorded_token_order_matches_megatron(single):
    # A padded batch (4 rows, several lengths) records, per sequence, exactly the routes of that sequence run
    # alone (b=1, no padding): the [s, b] sequence-major order and the padding handling are right.
    assert single["order_equal"]
    assert single["order_shapes"] == [(n, 4, 2) for n in LENGTHS]
    assert single["order_distinct_sequences"] == len(LENGTHS)


def test_r2_replay_after_the_weights_changed_has_zero_drift(single):
    check = single["r2_check"]
    assert check["ok"] and check["mismatches"] == 0 and check["checked"] == 4 * sum(LENGTHS)
    assert check["pad_dupes"] == 0
    # a different micro-batch split, packed into one row: still the recorded routes
    assert single["r2_packed_check"]["ok"]
    # without replay the same step moves the routing of the same batch (response tokens only)
    drift = single["drift_without_replay"]
    assert drift["expert_drift"] > 0.05 and drift["expert_drift_tokens_changed"] > 0.2
    assert all(drift[f"expert_drift_layer{i}"] > 0 for i in range(4))
    assert drift["expert_drift_num_tokens"] == sum(n - p + 1 for n, p in zip(LENGTHS, (4, 3, 2, 5, 6, 2, 3, 4)))


def test_router_weight_gets_gradients_under_replay(single):
    assert all(g > 1e-4 for g in single["r2_grads"])


def test_routes_memory_metric(single):
    # uint8 ids: tokens * layers * topk bytes
    assert single["r2_memory"] == {"routes_memory_bytes": float(sum(LENGTHS) * 4 * 2), "routes_tokens": float(sum(LENGTHS))}


def test_r3_replays_the_given_routes_exactly(single):
    assert single["r3_dtype"] == torch.uint8
    for name, check in single["r3"].items():
        assert check["ok"] and check["checked"] == 4 * sum(LENGTHS), name
        assert check["pad_dupes"] == 0, name


def test_full_recompute_replays_backward_fifo(single):
    # 4 micro-batches x 4 layers re-run the router in the backward pass with REPLAY_BACKWARD, in FIFO order
    assert single["recompute_calls"] == 16
    assert single["recompute_fwd"]["ok"] and single["recompute_bwd"]["ok"]
    torch.testing.assert_close(single["recompute_grads"], single["r2_grads"], rtol=1e-5, atol=0)


def test_refusals(single):
    errors = single["errors"]
    assert errors["fusion"] == (
        "moe.routing_replay=r2 cannot be used with moe_router_fusion=True: megatron-core skips replay in the "
        "fused router; disable router fusion"
    )
    assert "registry is empty" in errors["registry"]
    assert "parallel.virtual_pp" in errors["chunks"]
    assert "sees 32 tokens" in errors["tokens"] and "declared 64" in errors["tokens"]


@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
def test_layouts_replay_recorded_routes(layouts, single, name):
    for rank, results in enumerate(layouts):
        r = results[name]
        assert r["forward_check"]["ok"], (name, rank, r["forward_check"])
        assert r["recompute_check"]["ok"], (name, rank, r["recompute_check"])
        assert r["drift_without_replay"] > 0.05 and r["tokens_changed"] > 0.2, (name, rank)
        assert all(g > 1e-4 for g in r["router_grads"]), (name, rank)
        assert r["dtype"] == torch.uint8
        # what this layout recorded (gathered over TP / PP) equals the single-process routes
        assert set(r["routes"]) == set(r["seq_indices"])
        for i, routes in r["routes"].items():
            assert torch.equal(routes, single["reference_routes"][i]), (name, rank, i)


def test_layout_specifics(layouts, single):
    tp = [r["tp2_sp"] for r in layouts]
    assert all(r["local_layers"] == [0, 1, 2, 3] for r in tp)
    assert all(r["recompute_calls"] == 4 * 4 for r in tp)
    assert all(r["forward_check"]["checked"] < 4 * sum(LENGTHS) for r in tp)  # each TP rank routes its slice
    assert sum(r["forward_check"]["checked"] for r in tp) == 4 * sum(LENGTHS)
    for r in tp:  # replayed gradients equal the single-process ones
        torch.testing.assert_close(r["router_grads"], single["r2_grads"], rtol=1e-4, atol=1e-7)
    ep = [r["ep2"] for r in layouts]
    assert sorted(i for r in ep for i in r["seq_indices"]) == list(range(len(LENGTHS)))
    assert all(r["recompute_calls"] == 0 for r in ep)
    pp = [r["pp2_recompute"] for r in layouts]
    assert [r["local_layers"] for r in pp] == [[0, 1], [2, 3]]
    assert all(r["recompute_calls"] == 2 * 4 for r in pp)  # 2 layers x 4 micro-batches per stage
    assert pp[0]["memory"] == pp[1]["memory"] == sum(LENGTHS) * 2 * 2  # each stage stores its own layers
    torch.testing.assert_close(pp[0]["router_grads"] + pp[1]["router_grads"], single["r2_grads"], rtol=1e-4, atol=1e-7)
