"""Rollout statistics of two data-parallel ranks' shares combine into the whole batch's: means average (equal
shares), counts add up, and staleness_max is the larger of the two (a mean would hide the stalest group)."""

from megatron_gspo.metrics.log import combine_rollout_stats


def test_staleness_max_is_the_largest_over_ranks_counts_add_and_means_average():
    shares = [
        {"staleness_max": 0.0, "staleness_mean": 0.0, "groups_stale": 1.0, "reward_mean": 0.25,
         "producer_calls_peak": 2.0},
        {"staleness_max": 2.0, "staleness_mean": 1.0, "groups_stale": 2.0, "reward_mean": 0.75,
         "producer_calls_peak": 1.0},
    ]
    out = combine_rollout_stats(shares)
    assert out == {"staleness_max": 2.0, "staleness_mean": 0.5, "groups_stale": 3.0, "reward_mean": 0.5,
                   "producer_calls_peak": 2.0}
