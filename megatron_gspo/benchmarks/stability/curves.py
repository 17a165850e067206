"""Per-run curves of the stability benchmark and their aggregation over seeds (bands), read from run directories'
metrics.jsonl / eval.jsonl; used by the report (report.py) and its figures (plots.py)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.metrics.plot import read_jsonl


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation of the finite values (std 0 for one value; nan for none)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


@dataclass(frozen=True)
class Band:
    """A metric over steps across seeds: per step the mean, sample std, min and max over the seeds present."""

    steps: list[int]
    mean: list[float]
    std: list[float]
    low: list[float]
    high: list[float]
    seeds: list[int]
    """How many seeds had a value at each step."""


def seed_band(curves: Sequence[Sequence[tuple[int, float]]]) -> Band:
    """Aligns per-seed (step, value) curves by step; steps no seed logged are absent, None values skipped."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            if value is not None and math.isfinite(value):
                by_step.setdefault(int(step), []).append(float(value))
    steps = sorted(by_step)
    stats = [mean_std(by_step[s]) for s in steps]
    return Band(
        steps=steps,
        mean=[m for m, _ in stats],
        std=[s for _, s in stats],
        low=[min(by_step[s]) for s in steps],
        high=[max(by_step[s]) for s in steps],
        seeds=[len(by_step[s]) for s in steps],
    )


def curve(run_dir: Path, key: str, *, source: str = "metrics") -> list[tuple[int, float]]:
    """(step, value) of `key` from a run's metrics.jsonl (source='metrics') or eval.jsonl ('eval')."""
    rows = read_jsonl(run_dir / f"{source}.jsonl")
    return [(int(r["step"]), r[key]) for r in rows if r.get(key) is not None]
