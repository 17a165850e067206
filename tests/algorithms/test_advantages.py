"""Group advantages (Eq.6)."""

import math

import pytest
import torch

from megatron_gspo.algorithms import group_advantages


def _reference(rewards: list[float], group_size: int, normalize_std: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))  # population std
        for r in group:
            if max(group) == min(group):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_eq6_per_group(normalize_std):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.4, 0.4, 3.0, -1.0, 2.0, 0.5]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4, normalize_std=normalize_std)
    expected = torch.tensor(_reference(rewards, 4, normalize_std, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert got.dtype == torch.float64 and not got.requires_grad


def test_normalised_groups_have_zero_mean_and_unit_population_std():
    rewards = torch.randn(6 * 8, generator=torch.Generator().manual_seed(51))
    adv = group_advantages(rewards, 8).reshape(6, 8).double()
    torch.testing.assert_close(adv.mean(-1), torch.zeros(6, dtype=torch.float64), atol=1e-6, rtol=0)
    ones = torch.ones(6, dtype=torch.float64)
    torch.testing.assert_close(adv.std(-1, correction=0), ones, atol=1e-4, rtol=0)


def test_zero_variance_groups_give_exact_zeros_not_nan():
    # 0.1 * 7 groups: the float mean differs from 0.1 by rounding, which a tiny std would blow up.
    rewards = torch.tensor([0.1] * 7 + [1.0] * 7 + [0.0, 1.0] * 3 + [1.0], dtype=torch.float32)
    for normalize_std in (True, False):
        adv = group_advantages(rewards, 7, normalize_std=normalize_std, eps=0.0)
        assert torch.isfinite(adv).all()
        assert torch.all(adv[:14] == 0)
        assert adv[14:].abs().sum() > 0
    assert torch.all(group_advantages(torch.tensor([3.0, 5.0]), 1) == 0)


def test_bf16_rewards_are_computed_in_fp32():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.bfloat16), 4)
    assert adv.dtype == torch.float32
    assert adv[0].item() == pytest.approx(0.75 / math.sqrt(0.1875), rel=1e-5)


@pytest.mark.parametrize(
    "rewards, group_size, match",
    [
        (torch.zeros(6), 4, "multiple of group_size"),
        (torch.zeros(2, 4), 4, r"rewards must be \[B\]"),
        (torch.zeros(4), 0, "group_size"),
    ],
)
def test_bad_inputs_raise(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)
