"""Rollout / training mismatch correction: importance weights and their pre-truncation metrics."""

import math

import pytest
import torch

from megatron_gspo.algorithms import gspo_loss, rollout_correction
from tests.algorithms import reference as ref

LENGTHS = [4, 1, 6, 0, 3]


def _batch(noise=0.5, seed=61):
    rollout, train_old, mask = ref.make_batch(LENGTHS, 6, token_noise=noise, seed=seed)
    return train_old, rollout.detach(), mask  # train_old - rollout = -noise


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_token_level_weights(mode):
    train_old, rollout, mask = _batch()
    weights, metrics = rollout_correction(train_old, rollout, mask, level="token", mode=mode, threshold=1.3)
    assert weights.shape == mask.shape
    raw = []
    for i, length in enumerate(LENGTHS):
        for t in range(6):
            if t >= length:
                assert weights[i, t] == 0
                continue
            w = math.exp(float(train_old[i, t]) - float(rollout[i, t]))
            raw.append(w)
            expected = min(w, 1.3) if mode == "truncate" else (w if w <= 1.3 else 0.0)
            assert weights[i, t].item() == pytest.approx(expected, rel=1e-12)
    assert max(raw) > 1.3, "some weight must exceed the threshold"
    assert metrics["is_weight_max"].item() == pytest.approx(max(raw), rel=1e-6)  # logged BEFORE truncation
    assert metrics["is_weight_min"].item() == pytest.approx(min(raw), rel=1e-6)
    assert metrics["is_weight_mean"].item() == pytest.approx(sum(raw) / len(raw), rel=1e-6)
    assert metrics["is_weight_frac_above"].item() == pytest.approx(sum(w > 1.3 for w in raw) / len(raw))
    assert metrics["is_weight_count"].item() == len(raw)
    applied_mean = float(weights.sum()) / len(raw)
    assert metrics["is_weight_mean_applied"].item() == pytest.approx(applied_mean, rel=1e-6)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_sequence_level_weights_use_the_mean_log_ratio(mode):
    train_old, rollout, mask = _batch(noise=0.3)
    weights, metrics = rollout_correction(
        train_old, rollout, mask, level="sequence", mode=mode, threshold=1.1
    )
    assert weights.shape == (len(LENGTHS),)
    raw = []
    for i, length in enumerate(LENGTHS):
        if not length:
            assert weights[i] == 0
            continue
        mean = sum(float(train_old[i, t]) - float(rollout[i, t]) for t in range(length)) / length
        w = math.exp(mean)
        raw.append(w)
        expected = min(w, 1.1) if mode == "truncate" else (w if w <= 1.1 else 0.0)
        assert weights[i].item() == pytest.approx(expected, rel=1e-12)
    assert max(raw) > 1.1
    assert metrics["is_weight_max"].item() == pytest.approx(max(raw), rel=1e-6)
    assert metrics["is_weight_count"].item() == len(raw)


def test_sequence_level_is_not_the_product_of_token_ratios_on_long_responses():
    T = 4096
    rollout = torch.full((1, T), -1.0)
    train_old = rollout - 0.01  # a small, systematic per-token mismatch
    mask = torch.ones(1, T, dtype=torch.bool)
    weights, _ = rollout_correction(train_old, rollout, mask, level="sequence")
    # exp(sum) would be exp(-40.96) ~ 1.6e-18.
    assert weights.item() == pytest.approx(math.exp(-0.01), rel=1e-5)


def test_mismatch_kl_is_k3_for_samples_from_the_rollout_engine():
    train_old, rollout, mask = _batch()
    _, metrics = rollout_correction(train_old, rollout, mask, level="token")
    d = [float(train_old[i, t]) - float(rollout[i, t]) for i, n in enumerate(LENGTHS) for t in range(n)]
    k3 = sum(math.exp(x) - 1 - x for x in d) / len(d)
    assert metrics["mismatch_kl"].item() == pytest.approx(k3, rel=1e-5)
    assert metrics["mismatch_kl_k1"].item() == pytest.approx(-sum(d) / len(d), rel=1e-5)
    assert metrics["num_tokens"].item() == sum(LENGTHS) and metrics["num_sequences"].item() == 4


def test_off_returns_the_mask_and_still_reports_the_mismatch():
    train_old, rollout, mask = _batch()
    weights, metrics = rollout_correction(train_old, rollout, mask, level="off")
    assert torch.equal(weights, mask.to(weights.dtype))
    assert metrics["mismatch_kl"].item() > 0
    assert metrics["is_weight_mean_applied"].item() == 1.0


def test_weights_are_detached():
    train_old, rollout, mask = _batch()
    train_old = train_old.clone().requires_grad_(True)
    rollout = rollout.clone().requires_grad_(True)
    for level in ("token", "sequence"):
        weights, metrics = rollout_correction(train_old, rollout, mask, level=level)
        assert not weights.requires_grad
        assert all(not v.requires_grad for v in metrics.values())


def test_sequence_weights_scale_the_gspo_objective_through_the_advantages():
    lp, old, mask = ref.make_batch([3, 4], 4, seq_offsets=[1e-4, -1e-4], seed=62)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    weights = torch.tensor([0.5, 1.7], dtype=torch.float64)
    weighted = gspo_loss(lp, old, adv * weights, mask).loss
    per_seq = [
        gspo_loss(lp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], num_sequences=2).loss
        for i in range(2)
    ]
    torch.testing.assert_close(weighted, weights[0] * per_seq[0] + weights[1] * per_seq[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"level": "batch"}, "level='batch'"),
        ({"mode": "clip"}, "mode='clip'"),
        ({"threshold": 0.5}, "threshold"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    train_old, rollout, mask = _batch()
    with pytest.raises(ValueError, match=match):
        rollout_correction(train_old, rollout, mask, **kwargs)
