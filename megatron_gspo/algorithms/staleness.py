"""Metrics per staleness bucket, so that staleness can be told from a bug (clip fractions of 0.35 under async RL
mean something else when they come from 3-versions-old samples than from fresh ones).

Staleness of a sample = the weight version that consumes it (the RL step being trained) - the version that sampled
it (`Rollout.weight_version`). Bucket s's metrics are keyed "staleness_<s>/<name>" and combine across micro-batches
and data-parallel ranks like their unbucketed names (`metrics.combine_metrics`, weighted by the bucket's counts).

Legend: N = sequences, `*_N` per sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BUCKET_PREFIX = "staleness_"


def bucket_key(staleness: int, name: str) -> str:
    """The metric key of `name` in staleness bucket `staleness`."""
    return f"{BUCKET_PREFIX}{staleness}/{name}"


def by_staleness(
    staleness_N: torch.Tensor,
    compute: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    whole: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`compute(rows_N)` (bool row selection) for each staleness present, its keys prefixed by the bucket.

    `whole`: `compute` of all rows when the caller has it already; a batch of one staleness (synchronous RL:
    every batch) then gets copies of it instead of a recomputation over the same rows (the same values: the
    same ops on the same values)."""
    out: dict[str, torch.Tensor] = {}
    present = sorted({int(v) for v in staleness_N.tolist()})
    if whole is not None and len(present) == 1:
        return {bucket_key(present[0], name): value.clone() for name, value in whole.items()}
    for s in present:
        for name, value in compute(staleness_N == s).items():
            out[bucket_key(s, name)] = value
    return out


def rollout_bucket_stats(
    staleness_N: torch.Tensor, rewards_N: torch.Tensor, response_lens_N: torch.Tensor
) -> dict[str, torch.Tensor]:
    """samples, reward_mean and response_length per staleness bucket (0-dim fp32 each)."""

    def stats(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        n = rows.sum().to(torch.float64)
        return {
            "samples": n.float(),
            "reward_mean": (rewards_N[rows].to(torch.float64).sum() / n).float(),
            "response_length": (response_lens_N[rows].to(torch.float64).sum() / n).float(),
        }

    with torch.no_grad():
        return by_staleness(staleness_N, stats)


def has_stale_buckets(keys) -> bool:
    """Whether any bucketed key is of a staleness other than 0 (only then are buckets worth reporting: in
    synchronous RL every sample has staleness 0 and bucket 0 repeats the batch metrics)."""
    for key in keys:
        head, sep, _ = key.partition("/")
        if sep and head.startswith(BUCKET_PREFIX) and head != f"{BUCKET_PREFIX}0":
            return True
    return False
