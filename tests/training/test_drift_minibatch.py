"""Expert drift (GSPO §5.3): routes of the same tokens under pi_old vs after exactly one optimizer step, on the
second minibatch whenever K >= 2 (routing replay or not: one statistic across the stability benchmark's
variants). With free routing its own training forward gives the "after" routes (no extra forward); routing
replay keeps one extra forward of it after the first optimizer step; K = 1 measures the only minibatch. Checked against routes of our own
forwards and a drift computed here; recording in a training forward must not change training by a bit."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.trainer_ranks import drift_step


def _overlaps(before: dict, after: dict, rows: dict) -> tuple[list[int], int]:
    """Per layer, the sum over counted tokens of |S_before ∩ S_after|; and the number of tokens."""
    layers = len(next(iter(before.values()))[0])
    overlap, tokens = [0] * layers, 0
    for i, counted in rows.items():
        for t in counted:
            tokens += 1
            for layer in range(layers):
                overlap[layer] += len(set(before[i][t][layer]) & set(after[i][t][layer]))
    return overlap, tokens


def _expected_drift(before: dict, after: dict, rows: dict, topk: int) -> tuple[float, int]:
    """1 - mean over layers of (sum over counted tokens of |S_before ∩ S_after|) / (k * tokens)."""
    overlap, tokens = _overlaps(before, after, rows)
    return sum(1 - o / (topk * tokens) for o in overlap) / len(overlap), tokens


@pytest.mark.parametrize("overrides, minibatch, extra_forward", [
    ([], 1, False),                                                 # defaults: K = 4, free routing
    (["trainer.minibatches=1"], 0, True),                           # no second minibatch
    (["moe.routing_replay=r2"], 1, True),                           # training forwards replay routes: the same
    (["moe.routing_replay=r2", "trainer.minibatches=2"], 1, True),  # minibatch, by an extra forward
    (["moe.drift_sample_sequences=3"], 1, False),                   # the first 3 sequences of the minibatch
])
def test_drift_is_one_update_on_the_drift_minibatch(tmp_path, overrides, minibatch, extra_forward):
    out = run_distributed(drift_step, str(tmp_path / "r"), overrides, True, world_size=1)[0]
    probe = out["probe"]
    rows = probe["rows"][minibatch]
    if "moe.drift_sample_sequences=3" in overrides:
        rows = dict(list(rows.items())[:3])
    want, tokens = _expected_drift(probe["before"][minibatch], probe["after"][minibatch], rows, out["topk"])
    assert want > 0, "lr 0.05 should move some routes: the comparison would be vacuous"
    assert out["drift"]["expert_drift_num_tokens"] == tokens
    assert out["drift"]["expert_drift"] == pytest.approx(want, abs=1e-12)
    assert out["passes"] == (1 if extra_forward else 0)  # forward-only passes during the K updates


def test_recording_routes_in_a_training_forward_changes_no_result(tmp_path):
    on = run_distributed(drift_step, str(tmp_path / "on"), [], False, world_size=1)[0]
    off = run_distributed(drift_step, str(tmp_path / "off"), ["moe.drift_every=0"], False, world_size=1)[0]
    assert "expert_drift" in on["drift"] and "expert_drift" not in off["drift"]
    assert on["losses"] == off["losses"]
    assert len(on["params"]) == len(off["params"])
    assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]])
def test_drift_from_the_training_forward_in_model_parallel_layouts(tmp_path, layout):
    """The second minibatch's training forward records routes through 1F1B (pipeline stages hold other layers)
    and sequence-parallel slices (gathered over TP): the drift is the one computed here from every stage's own
    independent forwards of that minibatch before and after the first optimizer step."""
    ranks = run_distributed(drift_step, str(tmp_path / "r"), layout, True, world_size=2)
    stages = {tuple(r["layers"]): r["probe"] for r in ranks}  # PP: one entry per stage; TP: equal copies
    order = sorted(stages)
    assert [layer for ids in order for layer in ids] == [0, 1, 2, 3]

    def merged(side):
        first = stages[order[0]][side][1]
        return {i: [[ids for ids_stage in (stages[o][side][1][i][t] for o in order) for ids in ids_stage]
                    for t in range(len(first[i]))] for i in first}

    want, tokens = _expected_drift(merged("before"), merged("after"), stages[order[0]]["rows"][1], ranks[0]["topk"])
    assert want > 0
    for r in ranks:
        assert r["passes"] == 0
        assert r["drift"]["expert_drift_num_tokens"] == tokens
        assert r["drift"]["expert_drift"] == pytest.approx(want, abs=1e-12)


@pytest.mark.slow
def test_drift_from_the_training_forward_on_two_data_parallel_ranks_with_the_overlapping_distributed_optimizer(
        tmp_path):
    """DP = 2 with the distributed optimizer and both overlap flags (what a cluster runs) and the router aux loss on:
    each rank records its share of the second minibatch in its training forward, after the first optimizer step's
    parameter all-gather (overlap_param_gather finishes it in forward pre-hooks); the drift is one statistic of
    both ranks' tokens, computed here from each rank's own independent forwards before and after that step."""
    overrides = ["optim.distributed=true", "optim.overlap_grad_reduce=true", "optim.overlap_param_gather=true",
                 "model.overrides.router_aux_loss_coef=0.001"]
    ranks = run_distributed(drift_step, str(tmp_path / "r"), overrides, True, world_size=2)
    parts = [_overlaps(r["probe"]["before"][1], r["probe"]["after"][1], r["probe"]["rows"][1]) for r in ranks]
    tokens = sum(n for _, n in parts)
    overlap = [sum(o[layer] for o, _ in parts) for layer in range(len(parts[0][0]))]
    want = sum(1 - o / (ranks[0]["topk"] * tokens) for o in overlap) / len(overlap)
    assert want > 0 and all(n > 0 for _, n in parts)
    for r in ranks:
        assert r["passes"] == 0
        assert r["drift"]["expert_drift_num_tokens"] == tokens
        assert r["drift"]["expert_drift"] == pytest.approx(want, abs=1e-12)
