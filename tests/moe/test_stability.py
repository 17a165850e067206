"""Expert drift / routing mismatch on hand-built top-k sets; train / inference log-prob mismatch."""

import math

import pytest
import torch

from megatron_gspo.moe import (
    RouteStore,
    expert_drift,
    logprob_mismatch,
    response_token_mask,
    routing_mismatch,
    store_route_change,
    topk_overlap,
)

# 3 tokens, 2 layers, top-2.
OLD = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]])
NEW = torch.tensor([[[1, 0], [2, 5]], [[6, 7], [7, 6]], [[0, 1], [1, 0]]])
# overlaps: token 0 [2, 1], token 1 [0, 2], token 2 [2, 2]


def test_overlap_ignores_order():
    assert topk_overlap(OLD, NEW).tolist() == [[2, 1], [0, 2], [2, 2]]


def test_drift_by_hand():
    m = expert_drift(OLD, NEW)
    # 1 - (2+1+0+2+2+2) / (2 * 3 * 2) = 1 - 9/12
    assert m["expert_drift"].item() == pytest.approx(0.25)
    assert m["expert_drift_tokens_changed"].item() == pytest.approx(2 / 3)
    assert m["expert_drift_per_layer"].tolist() == pytest.approx([1 - 4 / 6, 1 - 5 / 6])
    assert m["expert_drift_tokens_changed_per_layer"].tolist() == pytest.approx([1 / 3, 1 / 3])
    assert m["expert_drift_num_tokens"].item() == 3


def test_drift_with_mask_and_identity():
    m = expert_drift(OLD, NEW, torch.tensor([True, False, True]))
    assert m["expert_drift"].item() == pytest.approx(1 - 7 / 8)
    assert m["expert_drift_tokens_changed"].item() == pytest.approx(0.5)
    assert m["expert_drift_per_layer"].tolist() == pytest.approx([0.0, 0.25])
    same = expert_drift(OLD, OLD.flip(-1))
    assert same["expert_drift"].item() == 0 and same["expert_drift_tokens_changed"].item() == 0
    empty = expert_drift(OLD, NEW, torch.zeros(3, dtype=torch.bool))
    assert empty["expert_drift"].item() == 0
    r = routing_mismatch(OLD.to(torch.uint8), NEW)
    assert r["routing_mismatch"].item() == pytest.approx(0.25)


def test_store_level_drift_matches_and_uses_response_masks():
    a = RouteStore.from_sequences({0: OLD[:2].to(torch.uint8), 1: OLD[2:].to(torch.uint8)}, num_experts=8)
    b = RouteStore.from_sequences({0: NEW[:2].to(torch.uint8), 1: NEW[2:].to(torch.uint8)}, num_experts=8)
    out = store_route_change(a, b)
    assert out["expert_drift"] == pytest.approx(0.25)
    assert out["expert_drift_tokens_changed"] == pytest.approx(2 / 3)
    assert out["expert_drift_layer0"] == pytest.approx(1 / 3) and out["expert_drift_layer1"] == pytest.approx(1 / 6)
    assert out["expert_drift_tokens_changed_layer1"] == pytest.approx(1 / 3)
    # sequence 0 with prompt length 2: only route row 1 (predicting the response token) counts
    assert response_token_mask(2, 2).tolist() == [False, True]
    masked = store_route_change(a, b, masks={0: response_token_mask(2, 2), 1: response_token_mask(1, 1)})
    assert masked["expert_drift"] == pytest.approx(1 - (0 + 2 + 2 + 2) / 8)
    assert masked["expert_drift_num_tokens"] == 2
    # rollout routes (all layers) vs a pipeline stage's routes (layer 1 only): compares the common layers
    stage = b.select_layers([1])
    partial = store_route_change(a, stage, prefix="routing_mismatch")
    assert set(k for k in partial if "layer" in k) == {"routing_mismatch_layer1", "routing_mismatch_tokens_changed_layer1"}
    assert partial["routing_mismatch"] == pytest.approx(1 / 6)


def test_logprob_mismatch_by_hand():
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    d = torch.tensor([[0.1, -0.1], [0.2, 5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    m = logprob_mismatch(rollout + d, rollout, mask)
    ds = [0.1, -0.1, 0.2]
    assert m["train_infer_kl"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in ds) / 3, rel=1e-5)
    assert m["train_infer_kl_k1"].item() == pytest.approx(-sum(ds) / 3, rel=1e-5, abs=1e-7)
    ratios = [1.0, math.exp(0.2)]
    assert m["train_infer_seq_ratio_mean"].item() == pytest.approx(sum(ratios) / 2, rel=1e-5)
    assert m["train_infer_seq_ratio_min"].item() == pytest.approx(1.0, rel=1e-5)
    assert m["train_infer_seq_ratio_max"].item() == pytest.approx(math.exp(0.2), rel=1e-5)
    assert m["train_infer_num_tokens"].item() == 3
