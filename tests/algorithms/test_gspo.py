"""GSPO (Eq.5, 7, 10) and its per-sequence-sums form against the reference formulas."""

import pytest
import torch

from megatron_gspo.algorithms import gspo_loss, gspo_loss_from_sums, sequence_ratio
from tests.algorithms import reference as ref

LENGTHS = [5, 1, 7, 3, 7, 6, 2, 4]
# Sequence log-ratios straddling both clip bounds of the paper's (3e-4, 4e-4) and of a wide (0.2, 0.27) range.
OFFSETS = [2e-3, -2e-3, 1e-4, -1e-4, 0.35, -0.3, 2e-3, -2e-3]
ADVANTAGES = [1.0, -0.7, 0.4, -1.2, 0.8, -0.5, -0.9, 1.3]


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.27)])
def test_loss_and_gradient_match_eq5_and_eq10(clip):
    lp, old, mask = ref.make_batch(LENGTHS, 8, seq_offsets=OFFSETS, seed=1)
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)
    low, high = clip

    out = gspo_loss(lp, old, adv, mask, clip_low=low, clip_high=high)
    (grad,) = torch.autograd.grad(out.loss, lp)

    lp_ref = lp.detach().clone().requires_grad_(True)
    expected = ref.gspo_objective(lp_ref, old, adv, mask, low, high, n=len(LENGTHS))
    (grad_ref,) = torch.autograd.grad(expected, lp_ref)
    _close(out.loss, expected)
    _close(grad, grad_ref)
    _close(grad, ref.gspo_grad(lp, old, adv, mask, low, high, n=len(LENGTHS)))

    ratios = [float(ref.seq_ratio(lp.detach(), old, mask, i)) for i in range(8)]
    flags = [ref.is_clipped(ratios[i], ADVANTAGES[i], low, high) for i in range(8)]
    n_low = sum(f[0] for f in flags)
    n_high = sum(f[1] for f in flags)
    assert n_low and n_high and n_low + n_high < 8, "the batch must exercise both clips and no clip"
    assert out.metrics["clip_frac_low_seq"].item() == pytest.approx(n_low / 8)
    assert out.metrics["clip_frac_high_seq"].item() == pytest.approx(n_high / 8)
    tokens = sum(LENGTHS)
    tok_low = sum(LENGTHS[i] for i in range(8) if flags[i][0])
    tok_high = sum(LENGTHS[i] for i in range(8) if flags[i][1])
    assert out.metrics["clip_frac_low_tok"].item() == pytest.approx(tok_low / tokens)
    assert out.metrics["clip_frac_high_tok"].item() == pytest.approx(tok_high / tokens)


def test_sequence_ratio_is_eq7_with_its_gradient():
    lp, old, mask = ref.make_batch([4, 1, 6], 6, token_noise=0.3, seed=2)
    s = sequence_ratio(lp, old, mask)
    weights = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    (grad,) = torch.autograd.grad((s * weights).sum(), lp)

    lp_ref = lp.detach().clone().requires_grad_(True)
    # Eq.7 literally: the |y_i|-th root of the product of token probability ratios.
    s_ref = []
    for i in range(3):
        idx = mask[i].nonzero().flatten()
        prod = torch.prod(torch.exp(lp_ref[i, idx]) / torch.exp(old[i, idx]))
        s_ref.append(prod ** (1.0 / len(idx)))
    s_ref = torch.stack(s_ref)
    (grad_ref,) = torch.autograd.grad((s_ref * weights).sum(), lp_ref)
    _close(s, s_ref)
    _close(grad, grad_ref)
    assert s.shape == (3,) and s.dtype == torch.float64


def test_clipped_sequence_contributes_zero_gradient_and_is_counted():
    # Rows: A>0 above 1+eps_high (clipped high), A<0 below 1-eps_low (clipped low), two unclipped mirrors.
    lengths = [3, 5, 2, 4]
    lp, old, mask = ref.make_batch(lengths, 5, seq_offsets=[1e-3, -1e-3, -1e-3, 1e-3], seed=3)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    out = gspo_loss(lp, old, adv, mask)
    out.loss.backward()
    assert torch.all(lp.grad[0] == 0) and torch.all(lp.grad[1] == 0)
    assert torch.all(lp.grad[2, :2] != 0) and torch.all(lp.grad[3, :4] != 0)
    assert torch.all(lp.grad[~mask] == 0)
    m = out.metrics
    assert m["clip_frac_high_seq"].item() == pytest.approx(0.25)
    assert m["clip_frac_low_seq"].item() == pytest.approx(0.25)
    assert m["clip_frac_high_tok"].item() == pytest.approx(3 / 14)
    assert m["clip_frac_low_tok"].item() == pytest.approx(5 / 14)


def test_no_length_bias_duplicated_response_keeps_its_weight():
    lp_short, old_short, mask_short = ref.make_batch([4], 4, token_noise=1e-4, garbage=False, seed=4)
    tokens_lp = lp_short.detach()
    lp_long = torch.cat([tokens_lp, tokens_lp], dim=1).requires_grad_(True)
    old_long = torch.cat([old_short, old_short], dim=1)
    mask_long = torch.ones(1, 8, dtype=torch.bool)
    adv = torch.tensor([0.7], dtype=torch.float64)

    short = gspo_loss(lp_short, old_short, adv, mask_short, num_sequences=4)
    long = gspo_loss(lp_long, old_long, adv, mask_long, num_sequences=4)
    short.loss.backward()
    long.loss.backward()
    _close(short.loss, long.loss)
    # The response's total weight (sum of its token gradients) is s A / N, whatever its length.
    _close(lp_short.grad.sum(), lp_long.grad.sum())
    assert long.loss.item() != 0 and lp_long.grad.abs().sum() > 0


def test_metrics_ratio_stats_kl_and_counts():
    lp, old, mask = ref.make_batch([3, 0, 5], 5, token_noise=0.05, seed=5)
    adv = torch.tensor([0.5, 2.0, -0.5], dtype=torch.float64)
    m = gspo_loss(lp, old, adv, mask).metrics
    ratios = [float(ref.seq_ratio(lp.detach(), old, mask, i)) for i in (0, 2)]
    assert m["seq_ratio_mean"].item() == pytest.approx(sum(ratios) / 2, rel=1e-6)
    assert m["seq_ratio_min"].item() == pytest.approx(min(ratios), rel=1e-6)
    assert m["seq_ratio_max"].item() == pytest.approx(max(ratios), rel=1e-6)
    assert m["approx_kl"].item() == pytest.approx(ref.k3_kl(lp, old, mask), rel=1e-5)
    assert m["num_sequences"].item() == 2 and m["num_tokens"].item() == 8
    for value in m.values():
        assert value.dtype == torch.float32 and value.dim() == 0 and not value.requires_grad


def test_from_sums_equals_gspo_loss_in_value_and_gradient_through_the_sums():
    lp, old, mask = ref.make_batch(LENGTHS, 8, seq_offsets=OFFSETS, seed=6)
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)
    direct = gspo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.27, num_sequences=10)
    (grad_direct,) = torch.autograd.grad(direct.loss, lp)

    # Sums assembled from two context-parallel column chunks, as a kernel would return them per rank.
    lp_masked = torch.where(mask, lp, 0.0)
    old_masked = torch.where(mask, old, 0.0)
    logprob_sum = lp_masked[:, :3].sum(-1) + lp_masked[:, 3:].sum(-1)
    old_sum = old_masked[:, :3].sum(-1) + old_masked[:, 3:].sum(-1)
    sums = gspo_loss_from_sums(
        logprob_sum, old_sum, mask.sum(-1), adv, clip_low=0.2, clip_high=0.27, num_sequences=10
    )
    (grad_sums,) = torch.autograd.grad(sums.loss, lp)
    _close(sums.loss, direct.loss)
    _close(grad_sums, grad_direct)
    for key, value in direct.metrics.items():
        if key != "approx_kl":
            _close(sums.metrics[key], value, tol=1e-6)


def test_from_sums_zero_count_rows_give_zero_loss_and_no_nan():
    logprob_sum = torch.tensor([-3.0, float("nan"), -2.0, float("-inf")], requires_grad=True)
    old_sum = torch.tensor([-3.1, float("inf"), -2.0, float("nan")])
    counts = torch.tensor([3, 0, 2, 0])
    adv = torch.tensor([1.0, float("nan"), -1.0, 5.0])
    out = gspo_loss_from_sums(logprob_sum, old_sum, counts, adv, clip_low=0.2, clip_high=0.2)
    out.loss.backward()
    s0 = torch.exp(torch.tensor(0.1 / 3))
    expected = -(s0 * 1.0 + 1.0 * -1.0) / 4
    _close(out.loss, expected, tol=1e-6)
    assert torch.isfinite(logprob_sum.grad).all()
    assert logprob_sum.grad[1] == 0 and logprob_sum.grad[3] == 0
    assert all(torch.isfinite(v) for k, v in out.metrics.items())
    assert out.metrics["num_sequences"].item() == 2


def test_old_logprobs_and_advantages_receive_no_gradient():
    lp, old, mask = ref.make_batch([3, 2], 3, seed=7)
    old = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64, requires_grad=True)
    gspo_loss(lp, old, adv, mask, clip_low=0.5, clip_high=0.5).loss.backward()
    assert old.grad is None and adv.grad is None and lp.grad is not None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"num_sequences": 0}, "num_sequences"),
        ({"num_sequences": 2.5}, "num_sequences"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(kwargs, match):
    lp, old, mask = ref.make_batch([2, 2], 2, seed=8)
    with pytest.raises(ValueError, match=match):
        gspo_loss(lp, old, torch.zeros(2), mask, **kwargs)


def test_shape_errors_are_clear():
    lp, old, mask = ref.make_batch([2, 2], 2, seed=9)
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(lp, old, torch.zeros(2, 2), mask)
    with pytest.raises(ValueError, match="same"):
        gspo_loss(lp, old[:, :1], torch.zeros(2), mask)
