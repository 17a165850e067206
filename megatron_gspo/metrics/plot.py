"""PNG curves from a run directory's metrics.jsonl / eval.jsonl (`megatron-gspo plot RUN_DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward", ("reward_mean", "accuracy")),
    ("clip_fraction", ("clip_frac_low_tok", "clip_frac_high_tok", "clip_frac_low_seq", "clip_frac_high_seq")),
    ("sequence_ratio", ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max")),
    ("kl", ("approx_kl", "mismatch_kl")),
    ("optimizer", ("grad_norm", "lr")),
    ("response_length", ("response_length",)),
)


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl file ([] when absent); a row that is not a JSON object with a `step` is a ValueError naming
    the file and line."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: not a JSON row ({err}); fix or delete that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{number}: a row needs an integer 'step'; fix or delete that line")
        rows.append(row)
    return rows


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes one PNG per panel (plus eval accuracy) into RUN_DIR/plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'} is missing or empty: nothing to plot")
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    steps = [r["step"] for r in rows]
    for name, keys in PANELS:
        present = [k for k in keys if any(r.get(k) is not None for r in rows)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k in present:
            ax.plot(steps, [r.get(k) for r in rows], label=k)
        ax.set_xlabel("RL step")
        ax.set_title(name.replace("_", " "))
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    evals = read_jsonl(run_dir / "eval.jsonl")
    if evals:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in evals], [r.get("eval_accuracy") for r in evals], marker="o")
        ax.set_xlabel("RL step")
        ax.set_title("held-out accuracy")
        fig.tight_layout()
        path = out_dir / "eval_accuracy.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
