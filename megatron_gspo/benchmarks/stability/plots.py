"""Figures of the stability benchmark: several variants x seeds as seed bands (`megatron-gspo stability`).
Single runs are plotted by metrics/plot.py (`megatron-gspo plot`)."""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.benchmarks.stability.curves import curve, seed_band
from megatron_gspo.metrics.plot import read_jsonl

VARIANT_COLORS = {
    "gspo": "tab:blue",
    "gspo_token": "tab:cyan",
    "gspo_r2": "tab:green",
    "grpo": "tab:red",
    "grpo_r2": "tab:orange",
    "grpo_r3": "tab:purple",
}
SMOOTH = 5
"""Steps of the trailing moving average applied to per-step training curves before the seed band."""


def _smooth(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Trailing moving average over the last `window` points (fewer at the start)."""
    out = []
    for i, (step, _) in enumerate(points):
        vals = [v for _, v in points[max(0, i - window + 1) : i + 1]]
        out.append((step, sum(vals) / len(vals)))
    return out


def _variant_band(by_seed: dict, key: str, source: str, smooth: int):
    """The seed band of one variant's `key` (each seed's curve smoothed first)."""
    curves = [curve(d, key, source=source) for d in by_seed.values()]
    if smooth > 1:
        curves = [_smooth(c, smooth) for c in curves]
    return seed_band(curves)


def _band_plot(
    ax, runs: dict, key: str, *, source: str = "metrics", scale: float = 1.0, smooth: int = SMOOTH,
    linestyle: str = "-", suffix: str = "",
) -> bool:
    """Per variant: the mean over seeds (line) and the min..max over seeds (shaded). True if anything drawn."""
    drawn = False
    for variant, by_seed in runs.items():
        band = _variant_band(by_seed, key, source, smooth)
        if not band.steps:
            continue
        color = VARIANT_COLORS.get(variant)
        n = max(band.seeds)
        ax.plot(band.steps, [m * scale for m in band.mean], color=color, linestyle=linestyle,
                marker="o" if source == "eval" else None, markersize=3, label=f"{variant}{suffix} (n={n})")
        if n > 1:
            ax.fill_between(band.steps, [v * scale for v in band.low], [v * scale for v in band.high], color=color,
                            alpha=0.18, linewidth=0)
        drawn = True
    return drawn


def _finish(fig, ax_list, path: Path, xlabel: str = "RL step", *, shared_legend: bool = False) -> Path:
    """Axis labels, grids and legends (one per axis, or one below the figure for axes with the same curves)."""
    for ax in ax_list:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if not shared_legend and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if shared_legend:
        handles, labels = ax_list[0].get_legend_handles_labels()
        ncol = len(labels) if len(labels) <= 6 else 5
        fig.legend(handles, labels, loc="lower center", ncol=max(ncol, 1), fontsize=7, frameon=False)
        rows = -(-len(labels) // max(ncol, 1))
        fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def stability_figures(out_dir: Path, runs: dict[str, dict[int, Path]]) -> list[Path]:
    """The benchmark's figures (PNG under OUT/plots): reward and held-out accuracy with seed bands, expert drift
    and tokens changed, drift per MoE layer over training, clip fractions (lower / upper, token / sequence) and
    the train / inference mismatch. `runs[variant][seed]` = run directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {v: s for v, s in runs.items() if s}
    plots = Path(out_dir) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    band_note = f"line: mean over seeds, shaded: min..max over seeds; {SMOOTH}-step moving average"

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    _band_plot(ax, runs, "reward_mean")
    ax.set_ylabel("training reward")
    ax.set_title(f"Training reward\n({band_note})", fontsize=9)
    written.append(_finish(fig, [ax], plots / "reward.png"))

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    _band_plot(ax, runs, "eval_accuracy", source="eval", smooth=1)
    ax.set_ylabel("held-out accuracy (avg@n)")
    ax.set_title("Held-out accuracy\n(line: mean over seeds, shaded: min..max over seeds)", fontsize=9)
    written.append(_finish(fig, [ax], plots / "heldout_accuracy.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    _band_plot(axes[0], runs, "expert_drift", scale=100)
    _band_plot(axes[0], runs, "expert_drift_rollout", scale=100, linestyle="--", suffix=", K steps")
    axes[0].set_ylabel("expert drift (%)")
    axes[0].set_title("1 - mean |S_old ∩ S_new| / k over response tokens and MoE layers\n"
                      "solid: after 1 optimizer step, dashed: after the K steps of the rollout batch", fontsize=9)
    _band_plot(axes[1], runs, "expert_drift_tokens_changed", scale=100)
    _band_plot(axes[1], runs, "expert_drift_rollout_tokens_changed", scale=100, linestyle="--", suffix=", K steps")
    axes[1].set_ylabel("tokens changed in >= 1 layer (%)")
    axes[1].set_title(f"Tokens whose top-k set changed in any layer\n({band_note})", fontsize=9)
    written.append(_finish(fig, list(axes), plots / "expert_drift.png", shared_legend=True))

    layer_keys = sorted(
        {k for by_seed in runs.values() for d in by_seed.values() for r in read_jsonl(d / "metrics.jsonl")[:1]
         for k in r if k.startswith("expert_drift_layer")},
        key=lambda k: int(k.removeprefix("expert_drift_layer")),
    )
    if layer_keys:
        cols = min(3, len(runs))
        rows_n = -(-len(runs) // cols)
        fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False, sharey=True)
        cmap = plt.get_cmap("viridis")
        flat = [a for row in axes for a in row]
        for ax, (variant, by_seed) in zip(flat, runs.items()):
            for j, key in enumerate(layer_keys):  # seed means only: per-layer bands overlap too much to read
                band = _variant_band(by_seed, key, "metrics", SMOOTH)
                ax.plot(band.steps, [100 * m for m in band.mean], color=cmap(j / max(len(layer_keys) - 1, 1)),
                        label=f"layer {key.removeprefix('expert_drift_layer')}")
            ax.set_title(variant, fontsize=9)
            ax.set_ylabel("drift per update (%)")
        for ax in flat[len(runs) :]:
            ax.axis("off")
        fig.suptitle(f"Expert drift per MoE layer after one optimizer step (mean over seeds, {SMOOTH}-step moving "
                     "average)", fontsize=10)
        written.append(_finish(fig, flat[: len(runs)], plots / "drift_per_layer.png", shared_legend=True))

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4), sharex=True)
    panels = (("clip_frac_low_tok", "tokens below 1 - eps_low"), ("clip_frac_high_tok", "tokens above 1 + eps_high"),
              ("clip_frac_low_seq", "responses below 1 - eps_low"), ("clip_frac_high_seq", "responses above 1 + eps_high"))
    for ax, (key, title) in zip(axes.flat, panels):
        _band_plot(ax, runs, key)
        ax.set_yscale("log", nonpositive="mask")  # GSPO and GRPO clip fractions lie orders of magnitude apart
        ax.set_title(f"clipped {title}", fontsize=9)
        ax.set_ylabel("fraction")
    fig.suptitle(f"Clip fractions (GSPO: eps 3e-4 / 4e-4; GRPO: 0.2 / 0.27), {band_note}", fontsize=9)
    written.append(_finish(fig, list(axes.flat), plots / "clip_fractions.png", shared_legend=True))

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    drawn = _band_plot(axes[0], runs, "mismatch_kl", smooth=1)
    axes[0].set_yscale("log", nonpositive="mask")
    axes[0].set_ylabel("KL(pi_rollout || pi_train), k3")
    axes[0].set_title("Train / inference log-prob mismatch (same tokens, same weights)", fontsize=9)
    if not drawn:
        axes[0].text(0.5, 0.5, "not measured (old log-probs from the engine)", ha="center", transform=axes[0].transAxes)
    drawn = _band_plot(axes[1], runs, "routing_mismatch", scale=100, smooth=1)
    axes[1].set_ylabel("routing mismatch (%)")
    axes[1].set_title("Rollout-engine routes vs trainer routes (1 - overlap / k)", fontsize=9)
    if not drawn:
        axes[1].text(0.5, 0.5, "engine records no routes", ha="center", transform=axes[1].transAxes)
    elif all(v == 0 for by_seed in runs.values() for d in by_seed.values() for _, v in curve(d, "routing_mismatch")):
        axes[1].text(0.5, 0.6, "0 at every step: the engine routed exactly as the trainer", ha="center",
                     transform=axes[1].transAxes, fontsize=8)
    written.append(_finish(fig, list(axes), plots / "train_inference_mismatch.png", shared_legend=True))
    return written
