"""Stability: long responses (T = 32768), fp32 and bf16 inputs, huge log-ratios, garbage in the padding."""

import math

import pytest
import torch

from megatron_gspo.algorithms import (
    LOG_RATIO_CLAMP,
    grpo_loss,
    gspo_loss,
    gspo_loss_from_sums,
    gspo_token_loss,
    rollout_correction,
    sequence_ratio,
)

T_LONG = 32768


def _long_batch(dtype, shift):
    """4 rows: full length, half length, one token, empty; log pi_theta = log pi_old + shift per row
    (huge positive, huge negative, tiny, tiny), padding filled with nan / inf / -inf."""
    gen = torch.Generator().manual_seed(41)
    old = -10.0 * torch.rand(4, T_LONG, generator=gen)
    lengths = torch.tensor([T_LONG, T_LONG // 2, 1, 0])
    mask = torch.arange(T_LONG)[None, :] < lengths[:, None]
    shifts = torch.tensor([shift, -shift, 1e-4, 1e-4])[:, None]
    new = old + shifts + 0.01 * torch.randn(4, T_LONG, generator=gen)
    pad = torch.tensor([math.nan, math.inf, -math.inf])[torch.arange(4 * T_LONG) % 3].reshape(4, T_LONG)
    new = torch.where(mask, new, pad)
    old = torch.where(mask, old, pad.roll(1, dims=1))
    return new.to(dtype).requires_grad_(True), old.to(dtype), mask


LOSSES = {
    "gspo": lambda lp, old, adv, mask: gspo_loss(lp, old, adv, mask),
    "gspo_token": lambda lp, old, adv, mask: gspo_token_loss(lp, old, adv[:, None].expand_as(lp), mask),
    "grpo": lambda lp, old, adv, mask: grpo_loss(lp, old, adv, mask),
    "grpo_token_mean": lambda lp, old, adv, mask: grpo_loss(lp, old, adv, mask, aggregation="token-mean"),
    "gspo_from_sums": lambda lp, old, adv, mask: gspo_loss_from_sums(
        torch.where(mask, lp.float(), 0.0).sum(-1),
        torch.where(mask, old.float(), 0.0).sum(-1),
        mask.sum(-1),
        adv,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("shift", [1.0, 80.0])
def test_long_responses_large_ratios_and_garbage_padding_stay_finite(dtype, name, shift):
    lp, old, mask = _long_batch(dtype, shift)
    # A < 0 on the row whose ratio explodes: the unclipped branch, where the ratio is not capped by the clip.
    adv = torch.tensor([-1.0, 1.0, 0.5, 3.0])
    out = LOSSES[name](lp, old, adv, mask)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert lp.grad.dtype == dtype
    assert torch.isfinite(lp.grad).all()
    assert torch.all(lp.grad[~mask] == 0)
    assert lp.grad[0].abs().sum() > 0  # the exploding row is unclipped and still gets a (finite) gradient
    for key, value in out.metrics.items():
        assert not torch.isnan(value), key
    assert torch.isfinite(out.metrics["approx_kl"])


def test_long_sequence_ratio_in_fp32_matches_fp64():
    gen = torch.Generator().manual_seed(42)
    old = -10.0 * torch.rand(2, T_LONG, generator=gen, dtype=torch.float64)
    new = old + 3e-4 + 0.05 * torch.randn(2, T_LONG, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, T_LONG, dtype=torch.bool)
    s64 = sequence_ratio(new, old, mask)
    s32 = sequence_ratio(new.float(), old.float(), mask)
    # The clip range is 3e-4 wide: fp32 must resolve the ratio far better than that.
    torch.testing.assert_close(s32.double(), s64, rtol=2e-6, atol=0)
    expected = torch.exp((new - old).mean(-1))
    torch.testing.assert_close(s64, expected, rtol=1e-12, atol=0)


def test_clamp_is_value_only_beyond_the_bound_and_exact_within():
    old = torch.zeros(3, 4, dtype=torch.float64)
    lp = torch.tensor([[30.0] * 4, [-30.0] * 4, [19.0] * 4], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 4, dtype=torch.bool)
    s = sequence_ratio(lp, old, mask)
    expected = torch.exp(torch.tensor([LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP, 19.0], dtype=torch.float64))
    torch.testing.assert_close(s, expected)
    s.sum().backward()
    # Straight-through: d s / d logp_t = s_clamped / |y| (Eq.10's factor at the saturated ratio), not 0.
    torch.testing.assert_close(lp.grad, (expected / 4)[:, None].expand(3, 4))


def test_rollout_correction_long_and_garbage_is_finite():
    lp, old, mask = _long_batch(torch.bfloat16, 80.0)
    for level in ("token", "sequence", "off"):
        weights, metrics = rollout_correction(old, lp, mask, level=level)
        assert torch.isfinite(weights).all()
        assert all(not torch.isnan(v) for v in metrics.values())
