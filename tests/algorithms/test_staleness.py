"""Metrics per staleness bucket on constructed batches of mixed staleness: each bucket's metrics equal the
independent formulas over that bucket's rows, and buckets combine across parts (micro-batches, ranks) that hold
different mixes of staleness."""

import math

import pytest
import torch

from megatron_gspo.algorithms import (
    by_staleness,
    combine_metrics,
    gspo_loss,
    has_stale_buckets,
    rollout_bucket_stats,
    rollout_correction,
)
from tests.algorithms import reference as ref

LENGTHS = [5, 2, 8, 3, 4, 6, 1, 7]
STALENESS = torch.tensor([0, 2, 0, 1, 2, 0, 1, 2])
T = 8


def test_rollout_stats_per_bucket():
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25, 0.0, 1.0, 0.75])
    lens = torch.tensor(LENGTHS)
    stats = rollout_bucket_stats(STALENESS, rewards, lens)
    for s in (0, 1, 2):
        rows = [i for i in range(8) if int(STALENESS[i]) == s]
        assert stats[f"staleness_{s}/samples"].item() == len(rows)
        assert stats[f"staleness_{s}/reward_mean"].item() == pytest.approx(sum(float(rewards[i]) for i in rows) / len(rows))
        assert stats[f"staleness_{s}/response_length"].item() == pytest.approx(sum(LENGTHS[i] for i in rows) / len(rows))
    assert len(stats) == 9


def test_loss_and_mismatch_metrics_per_bucket_combine_across_ranks():
    lp, old, mask = ref.make_batch(LENGTHS, T, seq_offsets=[3e-4, -5e-4, 1e-5, 6e-4, -1e-5, 2e-4, -7e-4, 1e-3],
                                   token_noise=0.05, seed=111)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -1.5, 0.3, -0.4, 0.9], dtype=torch.float64)
    lo, hi = 3e-4, 4e-4

    def part(rows):
        r = torch.tensor(rows)
        st = STALENESS[r]
        loss = by_staleness(st, lambda sel: gspo_loss(lp.detach()[r][sel], old[r][sel], adv[r][sel], mask[r][sel]).metrics)
        mism = by_staleness(st, lambda sel: rollout_correction(old[r][sel], lp.detach()[r][sel], mask[r][sel])[1])
        return {**loss, **mism}

    # Rank 0 holds staleness {0, 2}, rank 1 {0, 1, 2}: bucket 1 exists on one rank only.
    combined = combine_metrics([part([0, 1, 2, 4]), part([3, 5, 6, 7])])
    for s in (0, 1, 2):
        rows = [i for i in range(8) if int(STALENESS[i]) == s]
        ratios = [float(ref.seq_ratio(lp.detach(), old, mask, i)) for i in rows]
        flags = [ref.is_clipped(x, float(adv[i]), lo, hi) for x, i in zip(ratios, rows)]
        tokens = sum(LENGTHS[i] for i in rows)
        key = f"staleness_{s}/"
        assert combined[key + "num_sequences"].item() == len(rows)
        assert combined[key + "seq_ratio_mean"].item() == pytest.approx(sum(ratios) / len(rows), rel=1e-6)
        assert combined[key + "seq_ratio_max"].item() == pytest.approx(max(ratios), rel=1e-6)
        assert combined[key + "clip_frac_high_seq"].item() == pytest.approx(sum(h for _, h in flags) / len(rows))
        assert combined[key + "clip_frac_low_tok"].item() == pytest.approx(
            sum(LENGTHS[i] for (low, _), i in zip(flags, rows) if low) / tokens)
        d = [float(old[i, t]) - float(lp[i, t]) for i in rows for t in range(LENGTHS[i])]
        assert combined[key + "mismatch_kl"].item() == pytest.approx(
            sum(math.exp(x) - 1 - x for x in d) / len(d), rel=1e-5)
    assert 0 < combined["staleness_2/clip_frac_high_seq"] + combined["staleness_2/clip_frac_low_seq"]


def test_only_stale_buckets_are_worth_reporting():
    assert not has_stale_buckets(["staleness_0/clip_frac_low_tok", "clip_frac_low_tok"])
    assert has_stale_buckets(["staleness_0/samples", "staleness_3/samples"])
    assert not has_stale_buckets(["mismatch_kl"])


def test_a_batch_of_one_staleness_takes_the_batch_metrics_without_recomputing():
    lp, old, mask = ref.make_batch(LENGTHS, T, seq_offsets=[3e-4, -5e-4, 1e-5, 6e-4, -1e-5, 2e-4, -7e-4, 1e-3],
                                   token_noise=0.05, seed=112)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -1.5, 0.3, -0.4, 0.9], dtype=torch.float64)
    calls = []

    def compute(sel):
        calls.append(sel)
        return gspo_loss(lp.detach()[sel], old[sel], adv[sel], mask[sel]).metrics

    whole = gspo_loss(lp.detach(), old, adv, mask).metrics
    one = by_staleness(torch.full((8,), 3), compute, whole=whole)
    assert calls == [] and sorted(one) == sorted(f"staleness_3/{k}" for k in whole)
    # What it stands for: the recomputation over all rows (a bool selection of every row) gives the same bits.
    recomputed = by_staleness(torch.full((8,), 3), compute)
    assert len(calls) == 1
    assert all(torch.equal(one[k], recomputed[k]) for k in one)
    mixed = by_staleness(STALENESS, compute, whole=whole)
    assert len(calls) == 4 and {k.split("/")[0] for k in mixed} == {"staleness_0", "staleness_1", "staleness_2"}
