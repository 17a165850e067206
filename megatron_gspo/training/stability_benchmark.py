"""`megatron-gspo stability`: GSPO vs GRPO vs GRPO + Routing Replay on the same model, data and seeds.

Reproduces the paper's MoE finding (§5.3) as a report directory: report.md (a table per variant) and PNG plots of
reward, expert drift, clip fractions, sequence ratio and KL over RL steps. One cold-start SFT model is shared by all
variants (or `model.load` is used as given), so the variants differ only in the algorithm and routing replay.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from megatron_gspo.training.config import load_run_config
from megatron_gspo.training.plot import read_jsonl

log = logging.getLogger(__name__)

VARIANTS: dict[str, list[str]] = {
    "gspo": ["loss.algorithm=gspo", "moe.routing_replay=off"],
    "grpo": ["loss.algorithm=grpo", "moe.routing_replay=off"],
    "grpo_r2": ["loss.algorithm=grpo", "moe.routing_replay=r2"],
    "gspo_r2": ["loss.algorithm=gspo", "moe.routing_replay=r2"],
    "grpo_r3": ["loss.algorithm=grpo", "moe.routing_replay=r3"],
}
DEFAULT_VARIANTS = ("gspo", "grpo", "grpo_r2")
PLOTS = {
    "reward": ("reward_mean",),
    "expert_drift": ("expert_drift",),
    "clip_fraction": ("clip_frac_low_tok", "clip_frac_high_tok"),
    "sequence_ratio": ("seq_ratio_mean",),
    "kl": ("approx_kl",),
}


def steps_to_collapse(rewards: list[float], window: int = 5, floor: float = 0.1) -> int | None:
    """First step whose moving-average reward falls below half of the best moving average so far (once the
    best exceeds `floor`); None when the run never collapses."""
    best = 0.0
    for i in range(window, len(rewards) + 1):
        avg = sum(rewards[i - window : i]) / window
        if best >= floor and avg < 0.5 * best:
            return i
        best = max(best, avg)
    return None


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def summarise(run_dir: Path) -> dict:
    """Table row of one variant from its metrics.jsonl and summary.json."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [r["reward_mean"] for r in rows]
    tail = rewards[-5:] or [float("nan")]
    return {
        "final_reward": sum(tail) / len(tail),
        "best_reward": max(rewards) if rewards else float("nan"),
        "eval_before": summary.get("eval_accuracy_before"),
        "eval_after": summary.get("eval_accuracy_after"),
        "expert_drift": _mean(rows, "expert_drift"),
        "tokens_changed": _mean(rows, "expert_drift_tokens_changed"),
        "clip_low_tok": _mean(rows, "clip_frac_low_tok"),
        "clip_high_tok": _mean(rows, "clip_frac_high_tok"),
        "clip_seq": _mean(rows, "clip_frac_low_seq") + _mean(rows, "clip_frac_high_seq"),
        "collapse_step": steps_to_collapse(rewards),
        "steps": len(rows),
        "wall_seconds": summary.get("wall_seconds"),
    }


def write_report(out_dir: Path, variants: list[str]) -> Path:
    """report.md with the comparison table, plus one PNG per plotted metric with every variant on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {v: summarise(out_dir / v) for v in variants}
    lines = [
        "# MoE RL stability: GSPO vs GRPO vs GRPO + Routing Replay",
        "",
        "| variant | final reward | best reward | held-out acc before -> after | mean expert drift | tokens changed |"
        " clip low (tok) | clip high (tok) | clipped seqs | collapse step | steps | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, r in table.items():
        lines.append(
            f"| {v} | {r['final_reward']:.3f} | {r['best_reward']:.3f} | {r['eval_before']:.3f} -> {r['eval_after']:.3f}"
            f" | {r['expert_drift']:.4f} | {r['tokens_changed']:.3f} | {r['clip_low_tok']:.4f} | {r['clip_high_tok']:.4f}"
            f" | {r['clip_seq']:.3f} | {r['collapse_step'] or 'none'} | {r['steps']} | {r['wall_seconds']:.0f} |"
        )
    lines += [
        "",
        "Expert drift: 1 - mean |S_old ∩ S_new| / k over response tokens and MoE layers, routes of the first "
        "minibatch before vs after one optimizer step; tokens changed: fraction whose top-k set changed in any "
        "layer. Clip fractions are token-level means over steps; clipped seqs is the sequence-level (low + high).",
        "",
    ]
    for name, keys in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        for v in variants:
            rows = read_jsonl(out_dir / v / "metrics.jsonl")
            for key in keys:
                ys = [r.get(key) for r in rows]
                if any(y is not None for y in ys):
                    label = v if len(keys) == 1 else f"{v} {key}"
                    ax.plot([r["step"] for r in rows], ys, label=label)
        ax.set_xlabel("RL step")
        ax.set_title(name.replace("_", " "))
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        lines.append(f"![{name}]({name}.png)")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def run_stability(config: str | None, overrides: list[str], out_dir: str, variants: list[str]) -> Path:
    """SFT once (unless model.load is set), then each variant's RL run, then the report."""
    from megatron_gspo.training.sft import run_sft
    from megatron_gspo.training.trainer import GSPOTrainer

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown stability variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    out = Path(out_dir)
    base = load_run_config(config, overrides)
    start = time.time()
    extra = []
    if base.model.load is None:
        sft_dir = out / "sft_model"
        if not (sft_dir / "config.json").is_file():
            run_sft(base, out_dir=str(sft_dir))
        extra = [f"model.load={sft_dir}"]
    for v in variants:
        cfg = load_run_config(config, [*overrides, *VARIANTS[v], *extra, f"trainer.run_dir={out / v}"])
        log.info("stability: running %s", v)
        trainer = GSPOTrainer(cfg)
        try:
            trainer.train()
        finally:
            trainer.close()
    report = out / "report.md"
    if int(os.environ.get("RANK", "0")) == 0:  # every rank ran the variants; one writes the report
        write_report(out, variants)
    log.info("stability report written to %s (%.0f s)", report, time.time() - start)
    return report
