"""What the stability benchmark concludes from its run directories: a collapse verdict per run, seed
aggregation per variant, and report.md with its figures (the figures themselves: benchmarks/stability/plots.py).

Collapse rule (one verdict per run; stated in report.md and the README):
- reward collapse at step t: the 5-step moving average of the training reward falls below half of its best
  earlier moving average (once that best is at least 0.1) at step t, and stays below that half until the run
  ends;
- held-out collapse at step t: the held-out accuracy falls more than 5 points below its value before RL at the
  evaluation of step t, and stays more than 5 points below it at every later evaluation, the final one included.
A run collapses if either holds (the earlier step counts). A drop below half that recovers before the end is a
"dip" (reported, not a collapse); a run whose reward never reached 0.1 cannot collapse by the reward rule.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_gspo.benchmarks.stability.curves import mean_std
from megatron_gspo.metrics.plot import read_jsonl

REWARD_WINDOW = 5
"""Steps of the moving average the reward rule looks at."""
REWARD_FRACTION = 0.5
"""The reward rule fires below this fraction of the best moving average."""
REWARD_FLOOR = 0.1
"""The best moving average must reach this before the reward rule can fire (a run that never learned)."""
ACCURACY_MARGIN = 0.05
"""The held-out rule fires this far (absolute) below the accuracy before RL."""

COLLAPSE_RULE = (
    f"A run **collapses** at step t if (reward rule) the {REWARD_WINDOW}-step moving average of its training "
    f"reward falls below {REWARD_FRACTION:g} x its best earlier moving average (once that best is >= "
    f"{REWARD_FLOOR:g}) at t and stays below it to the end of the run, or (held-out rule) its held-out accuracy "
    f"falls more than {100 * ACCURACY_MARGIN:g} points below the accuracy before RL at the evaluation of step t "
    "and stays that low at every later evaluation, the final one included. A reward drop that recovers is a "
    "*dip*, not a collapse."
)


@dataclass(frozen=True)
class Verdict:
    """The collapse verdict of one run."""

    collapsed: bool
    step: int | None
    """RL step of the collapse (or of the first dip); None when neither happened."""
    reason: str
    """'reward', 'heldout', 'dip' or 'stable'."""

    def label(self) -> str:
        if self.collapsed:
            return f"collapsed@{self.step} ({self.reason})"
        return f"dip@{self.step}" if self.reason == "dip" else "stable"


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Entry i is the mean of values[i - window + 1 .. i] (defined from i = window - 1)."""
    return [math.fsum(values[i - window + 1 : i + 1]) / window for i in range(window - 1, len(values))]


def reward_collapse(steps: Sequence[int], rewards: Sequence[float]) -> tuple[int | None, int | None]:
    """(collapse step, first dip step) of a reward curve by the reward rule (module docstring)."""
    avg = _moving_average(rewards, REWARD_WINDOW)
    best, below = -math.inf, []
    for a in avg:
        below.append(best >= REWARD_FLOOR and a < REWARD_FRACTION * best)
        best = max(best, a)
    if not any(below):
        return None, None
    first = below.index(True)
    # The collapse starts where the final all-below stretch starts; it must reach the end of the run.
    start = None
    if below[-1]:
        start = len(below) - 1
        while start > 0 and below[start - 1]:
            start -= 1
    step = lambda j: int(steps[j + REWARD_WINDOW - 1])  # noqa: E731 - index of the moving average -> step
    return (step(start) if start is not None else None), step(first)


def heldout_collapse(evals: Sequence[tuple[int, float]]) -> int | None:
    """Collapse step by the held-out rule; `evals` = (step, accuracy) in step order, the first before RL."""
    if len(evals) < 2:
        return None
    start_acc = evals[0][1]
    low = [acc < start_acc - ACCURACY_MARGIN for _, acc in evals[1:]]
    if not low[-1]:
        return None
    i = len(low) - 1
    while i > 0 and low[i - 1]:
        i -= 1
    return int(evals[1 + i][0])


def collapse_verdict(
    steps: Sequence[int], rewards: Sequence[float], evals: Sequence[tuple[int, float]]
) -> Verdict:
    """The verdict of one run from its reward curve and its held-out evaluations (module docstring)."""
    r_step, dip = reward_collapse(steps, rewards)
    h_step = heldout_collapse(evals)
    found = [(s, why) for s, why in ((r_step, "reward"), (h_step, "heldout")) if s is not None]
    if found:
        s, why = min(found)
        return Verdict(True, s, why)
    if dip is not None:
        return Verdict(False, dip, "dip")
    return Verdict(False, None, "stable")


# ---- one run --------------------------------------------------------------------------------------------
_MEAN_KEYS = {
    "expert_drift": "expert_drift",
    "tokens_changed": "expert_drift_tokens_changed",
    "drift_rollout": "expert_drift_rollout",
    "tokens_changed_rollout": "expert_drift_rollout_tokens_changed",
    "clip_low_tok": "clip_frac_low_tok",
    "clip_high_tok": "clip_frac_high_tok",
    "clip_low_seq": "clip_frac_low_seq",
    "clip_high_seq": "clip_frac_high_seq",
    "mismatch_kl": "mismatch_kl",
    "routing_mismatch": "routing_mismatch",
    "frac_ratio_above_2": "mismatch_frac_ratio_above_2",
    "frac_ratio_outside_2": "mismatch_frac_ratio_outside_2",
    "router_flips_any_layer": "routing_mismatch_tokens_changed",
}
"""Run-table columns that are means over RL steps of one metrics.jsonl key. The R3 paper's metrics
(arXiv:2510.11370 §3) are mismatch_kl (k3 train / inference KL), frac_ratio_above_2 (F(tau = 2): share of
response tokens whose pi_train / pi_rollout exceeds 2; frac_ratio_outside_2 also counts those below 1/2, for the
reading of F(tau) over max(ratio, 1 / ratio)), router_flips_any_layer (share of response tokens routed
to another top-k set by the engine than by the trainer in >= 1 layer; the paper: 94%) and, per layer,
`router_flips_per_layer` (share of a layer's routers, one per token, whose top-k set differs; the paper: ~10%)."""
_ROUTER_FLIPS_LAYER = "routing_mismatch_tokens_changed_layer"


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return math.fsum(values) / len(values) if values else math.nan


def summarise_run(run_dir: Path) -> dict:
    """One run's row: rewards, held-out accuracy before / after, step means of drift, clip and mismatch
    metrics, and its collapse verdict."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [
        (int(e["step"]), float(e["eval_accuracy"]))
        for e in read_jsonl(run_dir / "eval.jsonl")
        if e.get("eval_accuracy") is not None
    ]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    steps = [int(r["step"]) for r in rows]
    rewards = [float(r["reward_mean"]) for r in rows]
    tail = rewards[-REWARD_WINDOW:]
    out = {
        "steps": len(rows),
        "final_reward": math.fsum(tail) / len(tail) if tail else math.nan,
        "best_reward": max(_moving_average(rewards, REWARD_WINDOW), default=max(rewards, default=math.nan)),
        "eval_before": evals[0][1] if evals else summary.get("eval_accuracy_before", math.nan),
        "eval_after": evals[-1][1] if evals else summary.get("eval_accuracy_after", math.nan),
        "wall_seconds": summary.get("wall_seconds", math.nan),
        "verdict": collapse_verdict(steps, rewards, evals),
    }
    out["eval_gain"] = out["eval_after"] - out["eval_before"]
    out.update({name: _mean(rows, key) for name, key in _MEAN_KEYS.items()})
    layers = sorted({int(k[len(_ROUTER_FLIPS_LAYER):]) for r in rows for k in r if k.startswith(_ROUTER_FLIPS_LAYER)})
    out["router_flips_per_layer"] = {layer: _mean(rows, f"{_ROUTER_FLIPS_LAYER}{layer}") for layer in layers}
    out["mismatch_kl_max"] = max((r["mismatch_kl"] for r in rows if r.get("mismatch_kl") is not None), default=math.nan)
    if _run_config(run_dir).get("rollout", {}).get("old_logprobs") == "engine":
        # pi_old IS the engine's then: the correction compares it with itself (0). The mismatch shows in the first
        # minibatch's ratio against it instead (before any update): `mismatch_approx_kl`, the loss's approx_kl
        # estimator (k3 per token; k1 for GSPO's per-sequence sums); F(2) is not measured.
        out.update(mismatch_kl=math.nan, mismatch_kl_max=math.nan, frac_ratio_above_2=math.nan,
                   frac_ratio_outside_2=math.nan)
    out["engine_ratio_kl"] = _mean(rows, "mismatch_approx_kl")
    full_lr = [r for r in rows if int(r["step"]) >= first_full_lr_step(run_dir)]
    for name in ("expert_drift", "tokens_changed", "drift_rollout", "tokens_changed_rollout"):
        # the drift of a warm-up update measures the warm-up
        out[name] = _mean(full_lr, _MEAN_KEYS[name])
    return out


def _run_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def first_full_lr_step(run_dir: Path) -> int:
    """First RL step whose first optimizer step runs at the peak learning rate (after linear warm-up), from the
    run's config.yaml: step s starts with optimizer step minibatches * (s - 1)."""
    cfg = _run_config(run_dir)
    if not cfg:
        return 1
    warmup, minibatches = int(cfg["optim"]["warmup_steps"]), int(cfg["trainer"]["minibatches"])
    return 1 + -(-warmup // minibatches)


AGGREGATED = (
    "final_reward",
    "best_reward",
    "eval_before",
    "eval_after",
    "eval_gain",
    "expert_drift",
    "tokens_changed",
    "drift_rollout",
    "tokens_changed_rollout",
    "clip_low_tok",
    "clip_high_tok",
    "clip_low_seq",
    "clip_high_seq",
    "mismatch_kl",
    "routing_mismatch",
    "frac_ratio_above_2",
    "frac_ratio_outside_2",
    "router_flips_any_layer",
    "wall_seconds",
)


def summarise_variant(run_rows: Sequence[dict]) -> dict:
    """Mean and std over seeds of each AGGREGATED column, plus `collapsed` (count) and `runs`."""
    out: dict = {key: mean_std([r[key] for r in run_rows]) for key in AGGREGATED}
    out["collapsed"] = sum(r["verdict"].collapsed for r in run_rows)
    out["runs"] = len(run_rows)
    return out


# ---- report.md ------------------------------------------------------------------------------------------
def _pm(value: tuple[float, float], digits: int, *, scale: float = 1.0) -> str:
    mean, std = value
    if not math.isfinite(mean):
        return "-"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


VARIANT_TITLES = {"gspo": "GSPO", "gspo_token": "GSPO-token", "grpo": "GRPO", "grpo_r2": "GRPO + R2",
                  "gspo_r2": "GSPO + R2", "grpo_r3": "GRPO + R3"}
"""How report.md's title names the variants it holds (benchmark.VARIANTS)."""


def _sci(value: tuple[float, float]) -> str:
    mean, std = value
    return "-" if not math.isfinite(mean) else f"{mean:.2e} ± {std:.1e}"


def write_report(
    out_dir: Path,
    runs: dict[str, dict[int, Path]],
    *,
    skipped: Sequence[str] = (),
    header: Sequence[str] = (),
) -> Path:
    """report.md: the variant table (mean ± std over seeds), the per-run table with verdicts, the collapse rule
    and the figures. `runs[variant][seed]` = run directory of a finished run."""
    from megatron_gspo.benchmarks.stability.plots import stability_figures

    rows = {v: {s: summarise_run(d) for s, d in sorted(seeds.items())} for v, seeds in runs.items()}
    agg = {v: summarise_variant(list(r.values())) for v, r in rows.items() if r}
    lines = [f"# MoE RL stability: {' vs '.join(VARIANT_TITLES.get(v, v) for v in agg)}", "", *header]
    lines += [
        "",
        "## Variants (mean ± std over seeds)",
        "",
        "| variant | seeds | collapsed | final reward | best reward | held-out before | held-out after | gain (pts) "
        "| drift / step (%) | tokens changed / step (%) | drift / rollout batch (%) | tokens changed / rollout "
        "batch (%) | clip low tok | clip high tok | clip low seq | clip high seq | train/infer KL | F(2) | F(2), both sides | router flips, "
        ">= 1 layer (%) | s per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, a in agg.items():
        lines.append(
            f"| {v} | {a['runs']} | {a['collapsed']}/{a['runs']} | {_pm(a['final_reward'], 3)} "
            f"| {_pm(a['best_reward'], 3)} | {_pm(a['eval_before'], 3)} | {_pm(a['eval_after'], 3)} "
            f"| {_pm(a['eval_gain'], 1, scale=100)} | {_pm(a['expert_drift'], 2, scale=100)} "
            f"| {_pm(a['tokens_changed'], 1, scale=100)} | {_pm(a['drift_rollout'], 2, scale=100)} "
            f"| {_pm(a['tokens_changed_rollout'], 1, scale=100)} | {_sci(a['clip_low_tok'])} | {_sci(a['clip_high_tok'])} "
            f"| {_sci(a['clip_low_seq'])} | {_sci(a['clip_high_seq'])} | {_sci(a['mismatch_kl'])} "
            f"| {_sci(a['frac_ratio_above_2'])} | {_sci(a['frac_ratio_outside_2'])} "
            f"| {_pm(a['router_flips_any_layer'], 1, scale=100)} "
            f"| {_pm(a['wall_seconds'], 0)} |"
        )
    lines += [
        "",
        "## Runs",
        "",
        "| variant | seed | verdict | final reward | best reward | held-out before -> after | expert drift (%) "
        "| tokens changed (%) | clip tok (low / high) | clip seq (low / high) | steps | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, by_seed in rows.items():
        for s, r in by_seed.items():
            lines.append(
                f"| {v} | {s} | {r['verdict'].label()} | {r['final_reward']:.3f} | {r['best_reward']:.3f} "
                f"| {r['eval_before']:.3f} -> {r['eval_after']:.3f} | {100 * r['expert_drift']:.2f} "
                f"| {100 * r['tokens_changed']:.1f} | {r['clip_low_tok']:.2e} / {r['clip_high_tok']:.2e} "
                f"| {r['clip_low_seq']:.2e} / {r['clip_high_seq']:.2e} | {r['steps']} | {r['wall_seconds']:.0f} |"
            )
    if skipped:
        lines += ["", f"Not run (budget): {', '.join(skipped)}."]
    lines += [
        "",
        "## Definitions",
        "",
        f"- {COLLAPSE_RULE}",
        "- Expert drift (GSPO paper §5.3): 1 - mean |S_old ∩ S_new| / k over the response tokens and MoE layers of "
        "one minibatch (the second at K >= 2, the first at K = 1; rows made before commit 9009678: the first), "
        "top-k sets under pi_old vs after the first optimizer step of the rollout batch; "
        "tokens changed: the fraction of those tokens whose top-k set changed in at least one layer. Means over "
        "the RL steps whose first update ran at the peak learning rate (after warm-up). Per rollout batch: the "
        "same sample's pi_old routes vs the routes after all K optimizer steps of the rollout batch.",
        "- Clip fractions: share of response tokens (tok) and mean per-response share (seq; for GSPO the share of "
        "responses) where the clip is active: ratio < 1 - eps_low with A < 0 (low) or ratio > 1 + eps_high with "
        "A > 0 (high); means over steps and minibatches.",
        "- Train/infer KL: k3 estimate of KL(pi_rollout || pi_train) on the same tokens (`mismatch_kl`), between the "
        "rollout engine's log-probs and the trainer's recomputed ones. F(2) and router flips are the R3 paper's "
        "(arXiv:2510.11370 §3): the share of response tokens whose pi_train / pi_rollout exceeds 2, and the share "
        "of response tokens the engine routes to another top-k set than the trainer in at least one layer (per "
        "layer in report.json: `router_flips_per_layer`). Measured with replay off on the steps that measure drift; "
        "an engine that is the trainer itself (rollout.local.dtype unset) shows none.",
        "- Final reward: mean of the last 5 steps; best reward: best 5-step moving average; held-out: avg@n accuracy "
        "before RL and at the last evaluation.",
        "",
        "## Figures",
        "",
    ]
    for path in stability_figures(out_dir, runs):
        lines.append(f"![{path.stem}]({path.relative_to(out_dir).as_posix()})")
        lines.append("")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (out_dir / "report.json").write_text(
        json.dumps(
            json_safe(
                {
                    v: {
                        "aggregate": agg[v],
                        "runs": {
                            str(s): {
                                **{k: x for k, x in r.items() if k != "verdict"},
                                "verdict": r["verdict"].label(),
                            }
                            for s, r in rows[v].items()
                        },
                    }
                    for v in agg
                }
            ),
            indent=2,
            default=float,
        )
    )
    return report


def json_safe(value):
    """NaN / inf -> None (strict JSON), recursively through dicts, lists and tuples."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
