"""Sweep: expert drift per optimizer step vs experts / top-k / MoE layers / learning rate / task (GSPO §5.3).

Each point is a set of dot-list overrides on one base config. A point trains its cold-start SFT model (shared
by every point with the same model, data and SFT settings), then runs a short GSPO run from it, and reports:
the expert drift per optimizer step (1 - mean |S_old ∩ S_new| / k over response tokens and MoE layers, mean over
the steps after lr warm-up), the fraction of tokens whose top-k set changed in >= 1 layer, the largest layer
drift, the reward and held-out accuracy movement and the seconds per RL step. Results are appended to
OUT/sweep.jsonl as each point finishes (a rerun skips points already there) and the table goes to OUT/sweep.md.
Asserts nothing. Usage (the README's table):

  python tools/drift_sweep.py --config examples/stability_moe.yaml --out runs/drift_sweep
  python tools/drift_sweep.py --out runs/drift_sweep --only e32k4,lr1e-4     # some points of the grid
  python tools/drift_sweep.py --out runs/my_sweep --point "lr2e-4: optim.lr=2e-4" --point "L8: \\
      model.overrides.num_hidden_layers=8"                                     # your own points

Wall times depend on the machine's load; the README's were measured on 2 shared cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
from pathlib import Path

# The README's grid, relative to examples/stability_moe.yaml (64 experts top-8, 6 layers, lr 3e-4, GSPO): one
# factor at a time around 32 experts top-4 ("e32k4"), then the algorithms and learning rates that decide the
# preset, then 60-step checks of the chosen learning rate.
E, K, L = (
    "model.overrides.num_experts",
    "model.overrides.num_experts_per_tok",
    "model.overrides.num_hidden_layers",
)
FFN, LR = "model.overrides.moe_intermediate_size", "optim.lr"
E32 = [f"{E}=32", f"{K}=4", f"{FFN}=64"]
GRPO, R2 = "loss.algorithm=grpo", "moe.routing_replay=r2"
DEFAULT_POINTS = {
    "e32k4": E32,
    "e8k2": [f"{E}=8", f"{K}=2", f"{FFN}=128"],
    "e64k8": [],
    "L3": [*E32, f"{L}=3"],
    "L12": [*E32, f"{L}=12"],
    "lr1e-4": [*E32, f"{LR}=1e-4"],
    "lr6e-4": [*E32, f"{LR}=6e-4"],
    "lr1e-3": [*E32, f"{LR}=1e-3"],
    "aux0": [*E32, "model.overrides.router_aux_loss_coef=0.0"],
    "add3": [*E32, "data.train=task:add3", "data.heldout=task:add3", "rollout.max_new_tokens=6"],
    "grpo": [*E32, GRPO],
    "grpo_r2": [*E32, GRPO, R2],
    "grpo_lr1e-4": [*E32, GRPO, f"{LR}=1e-4"],
    "grpo_lr1e-3": [*E32, GRPO, f"{LR}=1e-3"],
    "grpo_r2_lr1e-3": [*E32, GRPO, R2, f"{LR}=1e-3"],
    "e64k8_lr6e-4": [f"{LR}=6e-4"],
    "e32k4_60": [*E32, "trainer.steps=60"],
    "lr2e-4_60": [*E32, f"{LR}=2e-4", "trainer.steps=60"],
    "e64k8_60": ["trainer.steps=60"],
}
SFT_SECTIONS = ("model", "data", "sft", "parallel")
"""Config sections that decide the SFT model (optim, loss, rollout and trainer settings of RL do not)."""


def _sft_key(cfg) -> str:
    """Hash of the resolved sections that decide the SFT model (points that share them share it)."""
    tree = cfg.to_dict()
    relevant = {s: tree[s] for s in SFT_SECTIONS}
    relevant["model"] = {**relevant["model"], "load": None}
    relevant["seed"] = tree["trainer"]["seed"]
    return hashlib.blake2b(
        json.dumps(relevant, sort_keys=True, default=str).encode(), digest_size=6
    ).hexdigest()


def drift_row(name: str, overrides: list[str], run_dir: Path, sft: dict) -> dict:
    """One table row from a finished point's run directory (config.yaml, metrics.jsonl, eval.jsonl)."""
    from megatron_gspo.benchmarks.stability.report import first_full_lr_step
    from megatron_gspo.metrics.plot import read_jsonl
    from megatron_gspo.training.config import load_run_config

    cfg = load_run_config(run_dir / "config.yaml")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    full_lr = [r for r in rows if r["step"] >= first_full_lr_step(run_dir)] or rows

    def mean(key, sel=full_lr):
        vals = [r[key] for r in sel if r.get(key) is not None]
        return math.fsum(vals) / len(vals) if vals else math.nan

    layers = sorted({k for r in rows for k in r if k.startswith("expert_drift_layer")})
    m = cfg.model.model_config()
    rewards = [r["reward_mean"] for r in rows]
    total, active = m.num_parameters()
    return {
        "point": name,
        "overrides": overrides,
        "algorithm": cfg.loss.algorithm
        + ("+" + cfg.moe["routing_replay"] if cfg.moe.get("routing_replay", "off") != "off" else ""),
        "experts": m.num_experts,
        "topk": m.num_experts_per_tok,
        "layers": m.num_hidden_layers,
        "hidden": m.hidden_size,
        "lr": cfg.optim.lr,
        "aux": m.router_aux_loss_coef,
        "task": cfg.data.train,
        "response_tokens": mean("response_length", rows),
        "active_params": active,
        "total_params": total,
        "sft_steps": sft.get("sft_steps"),
        "sft_seconds": sft.get("sft_seconds"),
        "drift": mean("expert_drift"),
        "tokens_changed": mean("expert_drift_tokens_changed"),
        "max_layer_drift": max((mean(k) for k in layers), default=math.nan),
        "drift_rollout": mean("expert_drift_rollout"),
        "tokens_changed_rollout": mean("expert_drift_rollout_tokens_changed"),
        "reward_first": math.fsum(rewards[:3]) / max(len(rewards[:3]), 1),
        "reward_last": math.fsum(rewards[-3:]) / max(len(rewards[-3:]), 1),
        "eval_before": evals[0]["eval_accuracy"] if evals else math.nan,
        "eval_after": evals[-1]["eval_accuracy"] if evals else math.nan,
        "clip_seq": mean("clip_frac_low_seq") + mean("clip_frac_high_seq"),
        # Generation + old log-probs + updates + weight sync per RL step (evaluations excluded).
        "seconds_per_step": mean("time_generate", rows)
        + mean("time_old_logprobs", rows)
        + mean("time_update", rows)
        + mean("time_sync", rows),
        "rl_steps": len(rows),
    }


def run_point(config: str, base: list[str], name: str, overrides: list[str], out: Path, steps: int) -> dict:
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.sft import run_sft
    from megatron_gspo.training.trainer import GSPOTrainer

    every = [*base, *overrides]
    sft_dir = out / "sft" / _sft_key(load_run_config(config, every))
    meta_path = sft_dir / "sft_result.json"
    if not meta_path.is_file():
        result = run_sft(load_run_config(config, every), out_dir=str(sft_dir))
        meta_path.write_text(json.dumps(result))
    sft = json.loads(meta_path.read_text())
    run_dir = out / "rl" / name
    cfg = load_run_config(  # a point's own trainer.steps wins over --steps
        config,
        [
            f"trainer.steps={steps}",
            *every,
            f"model.load={sft_dir}",
            f"trainer.run_dir={run_dir}",
            "trainer.save_final=false",
            "trainer.progress=false",
            "eval.every=0",
        ],
    )
    trainer = GSPOTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return drift_row(name, overrides, run_dir, sft)


def _millions(row: dict) -> str:
    total = f"{row['total_params'] / 1e6:.2f}M " if "total_params" in row else ""
    return f"{total}({row['active_params'] / 1e6:.2f}M)"


def _pct(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:.2f}"


def table(rows: list[dict]) -> str:
    """The README's markdown table."""
    lines = [
        "| point | algorithm | experts / top-k | MoE layers | lr | aux | task (response tokens) | params (active) "
        "| SFT steps "
        "| drift / step (%) | tokens changed (%) | max layer drift (%) | drift / rollout batch (%) | RL steps "
        "| reward first -> last | held-out before -> after | clipped seqs | s / RL step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        task = r["task"].removeprefix("task:")
        lines.append(
            f"| {r['point']} | {r.get('algorithm', 'gspo')} | {r['experts']} / {r['topk']} | {r['layers']} "
            f"| {r['lr']:.0e} | {r['aux']:g} "
            f"| {task} ({r['response_tokens']:.0f}) | {_millions(r)} | {r['sft_steps']} "
            f"| {100 * r['drift']:.2f} | {100 * r['tokens_changed']:.1f} | {100 * r['max_layer_drift']:.2f} "
            f"| {_pct(r.get('drift_rollout'))} | {r['rl_steps']} "
            f"| {r['reward_first']:.3f} -> {r['reward_last']:.3f} | {r['eval_before']:.3f} -> {r['eval_after']:.3f} "
            f"| {r['clip_seq']:.3f} | {r['seconds_per_step']:.1f} |"
        )
    return "\n".join(lines)


def rebuild(out: Path) -> int:
    """Rows recomputed from OUT/rl/<point> (the SFT figures are kept from the old rows)."""
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines() if line.strip()]
    rows = [
        drift_row(
            r["point"],
            DEFAULT_POINTS.get(r["point"], r["overrides"]),
            out / "rl" / r["point"],
            {"sft_steps": r["sft_steps"], "sft_seconds": r["sft_seconds"]},
        )
        for r in rows
    ]
    (out / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = table(rows)
    (out / "sweep.md").write_text(md + "\n")
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/stability_moe.yaml")
    p.add_argument("--out", default="runs/drift_sweep")
    p.add_argument("--steps", type=int, default=20, help="RL steps per point")
    p.add_argument(
        "--point", action="append", default=[], help='"NAME: key=value key=value" (default: the grid)'
    )
    p.add_argument("--only", default="", help="comma list of default-grid point names to run")
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="recompute OUT/sweep.jsonl and sweep.md from the points' run directories (no training)",
    )
    p.add_argument("overrides", nargs="*", help="overrides applied to every point")
    args = p.parse_args(argv)
    if args.rebuild:
        return rebuild(Path(args.out))
    from megatron_gspo.training.runtime import configure_logging

    configure_logging()
    logging.getLogger("megatron_gspo").setLevel(logging.WARNING)
    points = dict(DEFAULT_POINTS)
    if args.point:
        points = {}
        for spec in args.point:
            name, _, rest = spec.partition(":")
            points[name.strip()] = rest.split()
    if args.only:
        points = {n: points[n] for n in args.only.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "sweep.jsonl"
    done = {}
    if results.is_file():
        done = {r["point"]: r for r in map(json.loads, results.read_text().splitlines()) if r}
    for i, (name, overrides) in enumerate(points.items(), start=1):
        if name in done:
            continue
        print(f"[{i}/{len(points)}] {name}: {' '.join(overrides) or '(base config)'}", flush=True)
        row = run_point(args.config, args.overrides, name, overrides, out, args.steps)
        done[name] = row
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(table([row]).splitlines()[-1], flush=True)
    md = table([done[n] for n in done])
    (out / "sweep.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
