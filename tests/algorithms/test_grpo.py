"""GRPO (Eq.2, gradient Eq.11) against the reference, for both aggregations and advantage shapes."""

import pytest
import torch

from megatron_gspo.algorithms import grpo_loss
from tests.algorithms import reference as ref

LENGTHS = [4, 1, 6, 0, 5]
T = 6


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("per_token", [False, True])
def test_loss_and_gradient_match_eq2_and_eq11(aggregation, per_token):
    lp, old, mask = ref.make_batch(LENGTHS, T, token_noise=0.6, seed=21)
    gen = torch.Generator().manual_seed(22)
    if per_token:
        adv = torch.randn(len(LENGTHS), T, generator=gen, dtype=torch.float64)
        adv_BT = adv
    else:
        adv = torch.tensor([1.0, -1.0, -0.5, 3.0, 0.8], dtype=torch.float64)
        adv_BT = adv[:, None].expand(-1, T)

    out = grpo_loss(lp, old, adv, mask, aggregation=aggregation, num_sequences=7, num_tokens=20)
    (grad,) = torch.autograd.grad(out.loss, lp)
    lp_ref = lp.detach().clone().requires_grad_(True)
    expected = ref.grpo_objective(lp_ref, old, adv_BT, mask, 0.2, 0.27, aggregation, n_seq=7, n_tok=20)
    (grad_ref,) = torch.autograd.grad(expected, lp_ref)
    _close(out.loss, expected)
    _close(grad, grad_ref)
    _close(grad, ref.grpo_grad(lp, old, adv_BT, mask, 0.2, 0.27, aggregation, n_seq=7, n_tok=20))

    low = high = 0
    for i, length in enumerate(LENGTHS):
        for t in range(length):
            w = float(torch.exp(lp.detach()[i, t] - old[i, t]))
            flag_low, flag_high = ref.is_clipped(w, float(adv_BT[i, t]), 0.2, 0.27)
            low += flag_low
            high += flag_high
    assert low and high, "the batch must exercise both clips"
    assert out.metrics["clip_frac_low_tok"].item() == pytest.approx(low / sum(LENGTHS))
    assert out.metrics["clip_frac_high_tok"].item() == pytest.approx(high / sum(LENGTHS))


def test_default_divisors_are_local_counts():
    lp, old, mask = ref.make_batch(LENGTHS, T, token_noise=0.4, seed=23)
    adv = torch.tensor([1.0, -1.0, -0.5, 3.0, 0.8], dtype=torch.float64)
    _close(grpo_loss(lp, old, adv, mask).loss, grpo_loss(lp, old, adv, mask, num_sequences=5).loss)
    _close(
        grpo_loss(lp, old, adv, mask, aggregation="token-mean").loss,
        grpo_loss(lp, old, adv, mask, aggregation="token-mean", num_tokens=sum(LENGTHS)).loss,
    )


def test_seq_clip_fraction_weighs_sequences_equally():
    # Row 0: 1 of 4 tokens clipped high; row 1: 2 of 2. Seq-level: (1/4 + 1) / 2; token-level: 3/6.
    old = torch.zeros(2, 4, dtype=torch.float64)
    lp = torch.tensor([[0.5, 0.0, 0.0, 0.0], [0.5, 0.5, 9.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = grpo_loss(lp, old, torch.tensor([1.0, 1.0]), mask)
    assert out.metrics["clip_frac_high_seq"].item() == pytest.approx((0.25 + 1.0) / 2)
    assert out.metrics["clip_frac_high_tok"].item() == pytest.approx(3 / 6)
    assert out.metrics["clip_frac_low_seq"].item() == 0.0


def test_unknown_aggregation_raises():
    lp, old, mask = ref.make_batch([2], 2, seed=24)
    with pytest.raises(ValueError, match="aggregation='sum'"):
        grpo_loss(lp, old, torch.ones(1), mask, aggregation="sum")
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(lp, old, torch.ones(1), mask, aggregation="token-mean", num_tokens=0)
