"""Off-policy corrections against independent formulas (loops over tokens, written here): the unbiased exp(sum)
and geometric exp(mean) sequence weights, two-sided (icepop) masks, the geometric mask band, F(tau = 2), presets,
the decoupled objective's value and gradient (autograd vs the hand derivative), broadcast shapes and masked-token
leakage."""

import dataclasses
import math

import pytest
import torch

from megatron_gspo.algorithms import (
    CORRECTION_PRESETS,
    RolloutCorrectionConfig,
    corrected_advantages,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    rollout_correction,
)
from tests.algorithms import reference as ref

LENGTHS = [4, 1, 6, 0, 3, 5]
T = 7


def _logprobs(noise=0.4, seed=81, garbage=True):
    """(prox [B, T], behav [B, T], mask): pi_prox - pi_behav = per-token noise on response tokens."""
    behav, prox, mask = ref.make_batch(LENGTHS, T, token_noise=noise, seed=seed, garbage=garbage)
    return prox, behav.detach(), mask


def _d(prox, behav, i):
    return [float(prox[i, t]) - float(behav[i, t]) for t in range(LENGTHS[i])]


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_product_sequence_weight_is_exp_of_the_sum(mode):
    prox, behav, mask = _logprobs(noise=0.3)
    weights, metrics = rollout_correction(prox, behav, mask, level="sequence", mode=mode, threshold=1.2,
                                          sequence_weight="product")
    raw = []
    for i, n in enumerate(LENGTHS):
        if not n:
            assert weights[i] == 0
            continue
        w = math.exp(sum(_d(prox, behav, i)))
        raw.append(w)
        expected = min(w, 1.2) if mode == "truncate" else (w if w <= 1.2 else 0.0)
        assert weights[i].item() == pytest.approx(expected, rel=1e-12)
    assert max(raw) > 1.2 and min(raw) < 1.0
    assert metrics["is_weight_max"].item() == pytest.approx(max(raw), rel=1e-6)


def test_both_sequence_weights_are_logged_whatever_the_level():
    prox, behav, mask = _logprobs(noise=0.3)
    geo = [math.exp(sum(_d(prox, behav, i)) / n) for i, n in enumerate(LENGTHS) if n]
    prod = [math.exp(sum(_d(prox, behav, i))) for i, n in enumerate(LENGTHS) if n]
    sums = [sum(_d(prox, behav, i)) for i, n in enumerate(LENGTHS) if n]
    for level in ("off", "token", "sequence"):
        _, m = rollout_correction(prox, behav, mask, level=level)
        assert m["seq_weight_geo_mean"].item() == pytest.approx(sum(geo) / len(geo), rel=1e-6)
        assert m["seq_weight_geo_min"].item() == pytest.approx(min(geo), rel=1e-6)
        assert m["seq_weight_geo_max"].item() == pytest.approx(max(geo), rel=1e-6)
        assert m["seq_weight_prod_mean"].item() == pytest.approx(sum(prod) / len(prod), rel=1e-6)
        assert m["seq_weight_prod_min"].item() == pytest.approx(min(prod), rel=1e-6)
        assert m["seq_weight_prod_max"].item() == pytest.approx(max(prod), rel=1e-6)
        assert m["seq_log_weight_sum_mean"].item() == pytest.approx(sum(sums) / len(sums), rel=1e-6)


def test_sum_and_mean_differ_by_orders_of_magnitude_on_a_long_answer():
    T_long = 4096
    behav = torch.full((1, T_long), -1.0)
    prox = behav - 0.01  # a small, systematic per-token mismatch
    mask = torch.ones(1, T_long, dtype=torch.bool)
    geo_w, m = rollout_correction(prox, behav, mask, level="sequence")
    prod_w, _ = rollout_correction(prox, behav, mask, level="sequence", sequence_weight="product")
    assert geo_w.item() == pytest.approx(math.exp(-0.01), rel=1e-5)
    assert m["seq_weight_geo_mean"].item() == pytest.approx(math.exp(-0.01), rel=1e-5)
    # exp(-40.96): logged as it is (fp64, |log| clamped at 50 only) ...
    assert m["seq_weight_prod_mean"].item() == pytest.approx(math.exp(-40.96), rel=1e-3)
    assert m["seq_log_weight_sum_mean"].item() == pytest.approx(-40.96, rel=1e-4)
    # ... while the applied product weight saturates at exp(-20) (the ratio clamp), still ~1e-9 of the geometric.
    assert prod_w.item() == pytest.approx(math.exp(-20.0), rel=1e-5)


def test_icepop_two_sided_token_mask():
    prox, behav, mask = _logprobs(noise=0.8)
    weights, metrics = rollout_correction(prox, behav, mask, level="token", mode="mask", threshold=2.0,
                                          mask_below=0.5)
    above = below = kept = 0
    for i, n in enumerate(LENGTHS):
        for t in range(T):
            if t >= n:
                assert weights[i, t] == 0
                continue
            w = math.exp(float(prox[i, t]) - float(behav[i, t]))
            if w > 2.0:
                above += 1
                assert weights[i, t] == 0
            elif w < 0.5:
                below += 1
                assert weights[i, t] == 0
            else:
                kept += 1
                assert weights[i, t].item() == pytest.approx(w, rel=1e-12)
    assert above and below and kept, "the batch must exercise both sides of the band"
    total = sum(LENGTHS)
    assert metrics["is_weight_frac_above"].item() == pytest.approx(above / total)
    assert metrics["is_weight_frac_below"].item() == pytest.approx(below / total)
    assert metrics["mismatch_frac_ratio_above_2"].item() == pytest.approx(above / total)


def test_f_tau_counts_tokens_whose_ratio_exceeds_two():
    prox, behav, mask = _logprobs(noise=0.9, seed=5)
    _, metrics = rollout_correction(prox, behav, mask, level="off")
    ratios = [math.exp(x) for i in range(len(LENGTHS)) for x in _d(prox, behav, i)]
    assert 0 < sum(r > 2 for r in ratios) < len(ratios)
    assert metrics["mismatch_frac_ratio_above_2"].item() == pytest.approx(sum(r > 2 for r in ratios) / len(ratios))


def test_geometric_mask_band_keeps_sequences_inside_it():
    prox, behav, mask = _logprobs(noise=0.02, seed=7)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25], dtype=torch.float64)
    cfg = RolloutCorrectionConfig(geo_mask_low=0.995, geo_mask_high=1.005)
    out = corrected_advantages(adv, prox, behav, mask, cfg)
    dropped = 0
    for i, n in enumerate(LENGTHS):
        geo = math.exp(sum(_d(prox, behav, i)) / n) if n else 1.0
        keep = not n or 0.995 <= geo <= 1.005
        dropped += not keep
        assert out.advantages_B[i].item() == (adv[i].item() if keep else 0.0)
    assert 0 < dropped < sum(1 for n in LENGTHS if n)
    assert out.metrics["geo_mask_frac"].item() == pytest.approx(dropped / sum(1 for n in LENGTHS if n))
    assert out.token_weights_BT is None


def test_presets_resolve_and_explicit_keys_override_them():
    for name, values in CORRECTION_PRESETS.items():
        resolved = RolloutCorrectionConfig(preset=name).resolved()
        for key, value in values.items():
            assert getattr(resolved, key) == value, (name, key)
    icepop = RolloutCorrectionConfig(preset="grpo_icepop", threshold=3.0).resolved()
    assert (icepop.level, icepop.mode, icepop.threshold, icepop.mask_below) == ("token", "mask", 3.0, 0.5)
    assert RolloutCorrectionConfig().resolved() == RolloutCorrectionConfig()
    assert not RolloutCorrectionConfig(preset="monitor").resolved().active
    assert RolloutCorrectionConfig(preset="gspo_geo_band").resolved().active


def test_a_key_set_to_its_usual_default_still_overrides_the_preset():
    # gspo_seq_mis masks at 2.0; "truncate" and 2.0 are also the keys' defaults when no preset is named.
    tis = RolloutCorrectionConfig(preset="gspo_seq_mis", mode="truncate").resolved()
    assert (tis.level, tis.mode, tis.threshold) == ("sequence", "truncate", 2.0)
    off = RolloutCorrectionConfig(preset="gspo_decoupled", level="off", threshold=2.0).resolved()
    assert (off.level, off.mode, off.threshold) == ("off", "mask", 2.0)
    # The config as written to disk (every key filled in) loads back to the same correction.
    again = RolloutCorrectionConfig(**dataclasses.asdict(tis)).resolved()
    assert again == tis


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"preset": "tis"}, r"rollout\.correction\.preset='tis'"),
        ({"mask_below": 1.5}, r"rollout\.correction\.mask_below"),
        ({"sequence_weight": "sum"}, r"rollout\.correction\.sequence_weight"),
        ({"geo_mask_low": 1.01}, r"rollout\.correction\.geo_mask_low"),
        ({"geo_mask_high": 0.99}, r"rollout\.correction\.geo_mask_high"),
        ({"geo_mask_high": -1.0}, r"rollout\.correction\.geo_mask_high"),
    ],
)
def test_bad_correction_keys_are_named(kwargs, key):
    with pytest.raises(ValueError, match=key):
        RolloutCorrectionConfig(**kwargs)


# ---- the decoupled objective (AReaL): J = (1/N) sum w min(r A, clip(r) A), r against pi_prox, w = prox / behav ----
def _three_policies(seed):
    """(theta leaf [B, T], prox [B, T], behav [B, T], mask): theta - prox small (inside / near the clip), prox -
    behav larger (the engine's gap)."""
    theta, prox, mask = ref.make_batch(LENGTHS, T, token_noise=2e-3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    behav = torch.where(mask, prox - 0.3 * torch.randn(prox.shape, generator=gen, dtype=torch.float64), prox)
    return theta, prox, behav, mask


def test_decoupled_gspo_sequence_form_value_and_gradient():
    theta, prox, behav, mask = _three_policies(seed=91)
    adv = torch.tensor([-1.0, 1.0, 0.5, 2.0, -0.7, 1.3], dtype=torch.float64)
    cfg = RolloutCorrectionConfig(preset="gspo_decoupled", threshold=1.2)
    out = corrected_advantages(adv, prox, behav, mask, cfg)
    lo, hi = 3e-4, 4e-4
    loss = gspo_loss(theta, prox, out.advantages_B, mask, clip_low=lo, clip_high=hi).loss
    (grad,) = torch.autograd.grad(loss, theta)

    n = len(LENGTHS)
    expected_loss = 0.0
    expected_grad = torch.zeros_like(grad)
    masked = clipped_seen = 0
    for i, length in enumerate(LENGTHS):
        if not length:
            continue
        w = math.exp(sum(float(prox[i, t]) - float(behav[i, t]) for t in range(length)) / length)
        w = w if w <= 1.2 else 0.0  # MIS
        masked += w == 0.0
        s = math.exp(sum(float(theta.detach()[i, t]) - float(prox[i, t]) for t in range(length)) / length)
        a = float(adv[i])
        low, high = ref.is_clipped(s, a, lo, hi)
        clipped_seen += low or high
        clipped = (1 - lo) * a if low else ((1 + hi) * a if high else s * a)
        expected_loss -= w * clipped / n
        if not (low or high):
            expected_grad[i, :length] = -w * s * a / (length * n)  # Eq.10 scaled by w
    assert masked and masked < n - 1 and clipped_seen
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10, abs=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-14)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_decoupled_grpo_token_form_value_and_gradient(aggregation):
    theta, prox, behav, mask = _three_policies(seed=93)
    theta = (theta.detach() + 0.2 * torch.where(mask, torch.randn(theta.shape, dtype=torch.float64), 0.0))
    theta = theta.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3], dtype=torch.float64)
    out = corrected_advantages(adv, prox, behav, mask, RolloutCorrectionConfig(preset="grpo_decoupled", threshold=1.25))
    adv_BT = out.advantages_B[:, None] * out.token_weights_BT
    eps = 0.1
    n_seq, n_tok = len(LENGTHS), sum(LENGTHS)
    loss = grpo_loss(theta, prox, adv_BT, mask, clip_low=eps, clip_high=eps, aggregation=aggregation,
                     num_sequences=n_seq, num_tokens=n_tok).loss
    (grad,) = torch.autograd.grad(loss, theta)

    expected_loss, expected_grad = 0.0, torch.zeros_like(grad)
    clipped_seen = 0
    for i, length in enumerate(LENGTHS):
        for t in range(length):
            w = math.exp(float(prox[i, t]) - float(behav[i, t]))
            w = w if w <= 1.25 else 0.0
            r = math.exp(float(theta.detach()[i, t]) - float(prox[i, t]))
            a = float(adv[i])
            low, high = ref.is_clipped(r, a, eps, eps)
            clipped_seen += low or high
            value = (1 - eps) * a if low else ((1 + eps) * a if high else r * a)
            scale = 1.0 / (length * n_seq) if aggregation == "seq-mean-token-mean" else 1.0 / n_tok
            expected_loss -= w * value * scale
            if not (low or high):
                expected_grad[i, t] = -w * r * a * scale  # Eq.11 scaled by w
    assert clipped_seen
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-14)


def test_broadcast_shapes():
    B, T_ = 3, 5  # B != T: a [B] x [B, 1] slip would show as a [B, B] result
    behav, prox, mask = ref.make_batch([5, 2, 4], T_, token_noise=0.3, seed=95)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for preset in CORRECTION_PRESETS:
        out = corrected_advantages(adv, prox, behav.detach(), mask, RolloutCorrectionConfig(preset=preset))
        assert out.advantages_B.shape == (B,), preset
        if out.token_weights_BT is not None:
            assert out.token_weights_BT.shape == (B, T_), preset
    # Token weights scale each token's advantage: gspo_token with [B, T] advantages = per-token weighted terms.
    theta, old, _ = ref.make_batch([5, 2, 4], T_, token_noise=1e-4, seed=96)
    out = corrected_advantages(adv, prox, behav.detach(), mask, RolloutCorrectionConfig(preset="grpo_token_tis"))
    per_token = gspo_token_loss(theta, old, out.advantages_B[:, None] * out.token_weights_BT, mask,
                                clip_low=0.5, clip_high=0.5).loss
    expected = 0.0
    for i, n in enumerate([5, 2, 4]):
        s = float(ref.seq_ratio(theta, old, mask, i))
        expected -= sum(s * float(adv[i]) * float(out.token_weights_BT[i, t]) for t in range(n)) / n / B
    assert per_token.item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("preset", list(CORRECTION_PRESETS))
def test_masked_tokens_with_huge_gaps_change_nothing(preset):
    prox, behav, mask = _logprobs(noise=0.3, garbage=False)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25], dtype=torch.float64)
    cfg = RolloutCorrectionConfig(preset=preset)
    clean = corrected_advantages(adv, prox, behav, mask, cfg)
    # Padding with log-prob gaps of +-60 (ratios e^60) and garbage: masked positions must not leak into anything.
    gap = torch.where(torch.arange(prox.numel()).reshape(prox.shape) % 2 == 0, 60.0, -60.0).to(prox.dtype)
    prox_bad = torch.where(mask, prox, gap)
    behav_bad = torch.where(mask, behav, -gap)
    dirty = corrected_advantages(adv, prox_bad, behav_bad, mask, cfg)
    assert torch.equal(clean.advantages_B, dirty.advantages_B)
    if clean.token_weights_BT is not None:
        assert torch.equal(clean.token_weights_BT, dirty.token_weights_BT)
    assert clean.metrics.keys() == dirty.metrics.keys()
    for key in clean.metrics:
        assert torch.equal(clean.metrics[key], dirty.metrics[key]), key


def test_per_token_advantages_are_scaled_and_dropped_per_row():
    """Multi-turn per-turn advantages [B, T] take the row's sequence weight and mask band, as [B] advantages do
    (and `loss.mask_truncated` zeroes a truncated row's)."""
    from megatron_gspo.algorithms import mask_truncated_advantages

    prox, behav, mask = _logprobs(noise=0.02, seed=7)
    gen = torch.Generator().manual_seed(3)
    adv_BT = torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64)
    cfg = RolloutCorrectionConfig(level="sequence", geo_mask_low=0.995, geo_mask_high=1.005)
    row = corrected_advantages(torch.ones(len(LENGTHS), dtype=torch.float64), prox, behav, mask, cfg).advantages_B
    assert 0 < int((row == 0).sum()) < len(LENGTHS) and bool((row[row != 0] != 1).any())
    out = corrected_advantages(adv_BT, prox, behav, mask, cfg).advantages_B
    for i in range(len(LENGTHS)):
        for t in range(T):
            assert out[i, t].item() == pytest.approx(adv_BT[i, t].item() * row[i].item(), rel=1e-12, abs=0)
    truncated = torch.tensor([True, False, True, False, False, True])
    cut = mask_truncated_advantages(adv_BT, truncated)
    assert torch.equal(cut[truncated], torch.zeros(3, T)) and torch.equal(cut[~truncated], adv_BT[~truncated])
