"""Overlong answers: DAPO's soft overlong punishment against its piecewise definition, and loss.mask_truncated
(truncated rows get no gradient, the others exactly the gradient they had)."""

import pytest
import torch

from megatron_gspo.algorithms import (
    grpo_loss,
    gspo_loss,
    mask_truncated_advantages,
    overlong_penalty,
    overlong_stats,
)
from tests.algorithms import reference as ref


def _dapo(length: int, l_max: int, l_cache: int) -> float:
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return (l_max - l_cache - length) / l_cache
    return -1.0


def test_penalty_is_dapos_piecewise_function():
    lens = torch.arange(0, 24)
    got = overlong_penalty(lens, max_length=20, buffer=8, factor=1.0)
    for length, value in zip(lens.tolist(), got.tolist()):
        assert value == pytest.approx(_dapo(length, 20, 8), abs=1e-7), length
    assert got[20].item() == pytest.approx(-1.0) and got[12].item() == 0.0 and got[13].item() < 0
    half = overlong_penalty(lens, max_length=20, buffer=8, factor=0.5)
    torch.testing.assert_close(half, 0.5 * got)
    assert torch.equal(overlong_penalty(lens, max_length=20, buffer=0), torch.zeros(24))


def test_penalty_rejects_a_buffer_longer_than_the_answer():
    with pytest.raises(ValueError, match="loss.overlong_buffer"):
        overlong_penalty(torch.arange(3), max_length=4, buffer=5)


def test_stats_count_truncated_and_penalised_answers():
    truncated = torch.tensor([True, False, False, True, False])
    penalty = torch.tensor([-1.0, 0.0, -0.25, -1.0, 0.0])
    stats = overlong_stats(truncated, penalty)
    assert stats["samples"].item() == 5
    assert stats["truncated_frac"].item() == pytest.approx(2 / 5)
    assert stats["overlong_penalized_frac"].item() == pytest.approx(3 / 5)
    assert stats["overlong_penalty_mean"].item() == pytest.approx(-2.25 / 5)


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_masked_truncated_rows_get_zero_gradient_and_the_others_are_unchanged(algorithm):
    lengths = [4, 6, 3, 6, 5]
    lp, old, mask = ref.make_batch(lengths, 6, token_noise=1e-4, seed=101)
    adv = torch.tensor([1.0, -0.5, 0.7, 2.0, -1.2], dtype=torch.float64)
    truncated = torch.tensor([False, True, False, True, False])  # the rows that hit max_new_tokens (6)
    masked_adv = mask_truncated_advantages(adv, truncated)

    def loss_of(a):
        if algorithm == "gspo":
            return gspo_loss(lp, old, a, mask).loss
        return grpo_loss(lp, old, a, mask, clip_low=0.2, clip_high=0.2).loss

    (grad,) = torch.autograd.grad(loss_of(masked_adv), lp)
    assert torch.all(grad[truncated] == 0)
    # Every other row: its own hand derivative, with the batch size N = 5 (truncated rows count in it).
    lo, hi = (3e-4, 4e-4) if algorithm == "gspo" else (0.2, 0.2)
    keep = ~truncated
    expected_fn = ref.gspo_grad if algorithm == "gspo" else (
        lambda *a: ref.grpo_grad(*a[:6], "seq-mean-token-mean", a[6], None)
    )
    adv_arg = adv if algorithm == "gspo" else adv[:, None].expand(5, 6)
    expected = expected_fn(lp, old, adv_arg, mask, lo, hi, 5)
    torch.testing.assert_close(grad[keep], expected[keep], rtol=1e-9, atol=1e-14)
    assert grad[keep].abs().sum() > 0
