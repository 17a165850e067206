"""Balanced assignment of sequences (by token count) to micro-batches and to data-parallel ranks.

Pure Python. Every function is deterministic in its inputs (ties break by index), so ranks that hold the same
lengths compute the same assignment without communicating.

- `balanced_bins(lengths, k)`: k bins, longest-processing-time-first (each sequence, longest first, goes to the
  least loaded bin): the largest bin is at most 4/3 of the optimum (Graham 1969).
- `token_budget_bins(lengths, budget)`: the fewest LPT bins (from ceil(total / budget) up) whose loads all fit the
  budget; `refine_bins` turns a feasible assignment into exactly k >= its size bins that still fit.
- `equal_count_partition(lengths, k)`: k parts of equal size (len(lengths) / k each) with balanced loads: the
  data-parallel deal, where every rank must keep the same number of sequences per minibatch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def _order(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))


def balanced_bins(lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Indices of `lengths` in `num_bins` non-empty bins with balanced sums (LPT); each bin ascending, bins in order
    of their first index."""
    if not 1 <= num_bins <= len(lengths):
        raise ValueError(f"cannot put {len(lengths)} sequences into {num_bins} non-empty bins")
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in _order(lengths):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), b))
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def bin_loads(lengths: Sequence[int], bins: list[list[int]]) -> list[int]:
    return [sum(int(lengths[i]) for i in b) for b in bins]


def token_budget_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The fewest balanced bins whose token sums are all <= `budget` (a sequence longer than it is an error)."""
    if budget < 1:
        raise ValueError(f"token budget {budget} must be >= 1")
    longest = max(int(x) for x in lengths)
    if longest > budget:
        raise ValueError(
            f"a sequence feeds {longest} tokens but trainer.max_tokens_per_micro_batch={budget}; raise the budget "
            "to at least the longest prompt + response"
        )
    total = sum(int(x) for x in lengths)
    for k in range(max(1, -(-total // budget)), len(lengths) + 1):
        bins = balanced_bins(lengths, k)
        if max(bin_loads(lengths, bins)) <= budget:
            return bins
    raise AssertionError("one sequence per bin always fits")  # unreachable: longest <= budget


def refine_bins(lengths: Sequence[int], bins: list[list[int]], num_bins: int, budget: int | None) -> list[list[int]]:
    """Exactly `num_bins` (>= len(bins)) bins within `budget`: a fresh balanced assignment if it fits, else `bins`
    with its fullest multi-sequence bins split in two until there are enough (splitting never exceeds a budget the
    bins fit)."""
    if num_bins < len(bins) or num_bins > len(lengths):
        raise ValueError(f"cannot refine {len(bins)} bins of {len(lengths)} sequences into {num_bins}")
    fresh = balanced_bins(lengths, num_bins)
    if budget is None or max(bin_loads(lengths, fresh)) <= budget:
        return fresh
    out = [list(b) for b in bins]
    while len(out) < num_bins:
        loads = bin_loads(lengths, out)
        j = max((j for j in range(len(out)) if len(out[j]) > 1), key=lambda j: (loads[j], -j))
        part = out.pop(j)
        sub = [lengths[i] for i in part]
        out.extend([[part[i] for i in b] for b in balanced_bins(sub, 2)])
    return sorted((sorted(b) for b in out), key=lambda b: b[0])


def equal_count_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """`parts` groups of exactly len(lengths) / parts indices each, balanced by sum (LPT over the groups with room)."""
    n = len(lengths)
    if parts < 1 or n % parts:
        raise ValueError(f"{n} sequences do not split into {parts} equal parts")
    cap = n // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in _order(lengths):
        g = min((g for g in range(parts) if len(groups[g]) < cap), key=lambda g: (loads[g], g))
        groups[g].append(i)
        loads[g] += int(lengths[i])
    return [sorted(g) for g in groups]
