"""`megatron-gspo` command line: train | sft | eval | demo | stability | convert | plan | plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_gspo.yaml"
STABILITY_CONFIG = DEMO_CONFIG.parent / "stability_moe.yaml"


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML run config (examples/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. trainer.steps=50 parallel.tp=2")


def _load(args):
    from megatron_gspo.training.config import load_run_config

    return load_run_config(args.config, args.overrides)


def cmd_train(args) -> int:
    from megatron_gspo.training.runtime import configure_logging
    from megatron_gspo.training.trainer import GSPOTrainer

    configure_logging()
    trainer = GSPOTrainer(_load(args), resume=args.resume)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if trainer.rt.is_logging_rank:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_sft(args) -> int:
    from megatron_gspo.training.runtime import configure_logging
    from megatron_gspo.training.sft import run_sft

    configure_logging()
    result = run_sft(_load(args), out_dir=args.out)
    print(json.dumps(result, indent=2))
    return 0


def cmd_eval(args) -> int:
    from megatron_gspo.training.evaluate import evaluate
    from megatron_gspo.training.runtime import Runtime, configure_logging

    configure_logging()
    cfg = _load(args)
    rt = Runtime(cfg, cfg.optim, 1)
    try:
        result = evaluate(rt, seed=cfg.trainer.seed)
    finally:
        rt.close()
    if rt.is_logging_rank:
        print(json.dumps(result, indent=2))
    return 0


def cmd_demo(args) -> int:
    """Cold-start SFT then GSPO on the embedded default (tiny Qwen3-MoE, 3-digit addition, CPU)."""
    import time

    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.runtime import configure_logging
    from megatron_gspo.training.sft import run_sft
    from megatron_gspo.training.trainer import GSPOTrainer

    configure_logging()
    run_dir = Path(args.run_dir)
    start = time.time()
    cfg = load_run_config(args.config or DEMO_CONFIG, [f"trainer.run_dir={run_dir}", *args.overrides])
    sft = run_sft(cfg, out_dir=str(run_dir / "sft_model"))
    rl_cfg = load_run_config(
        args.config or DEMO_CONFIG, [f"trainer.run_dir={run_dir}", f"model.load={run_dir / 'sft_model'}", *args.overrides]
    )
    trainer = GSPOTrainer(rl_cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    if trainer.rt.is_logging_rank:
        total = time.time() - start
        print(
            f"\nembedded default: cold-start SFT {sft['sft_steps']} steps ({sft['sft_seconds']:.0f} s), "
            f"GSPO {summary['steps']} steps ({summary['wall_seconds']:.0f} s), total {total:.0f} s\n"
            f"held-out accuracy (avg@{rl_cfg.eval.n}): before RL {summary['eval_accuracy_before']:.3f} -> "
            f"after RL {summary['eval_accuracy_after']:.3f} "
            f"({100 * (summary['eval_accuracy_after'] - summary['eval_accuracy_before']):+.1f} points)"
        )
    return 0


def cmd_stability(args) -> int:
    from megatron_gspo.training.runtime import configure_logging
    from megatron_gspo.training.stability_benchmark import run_stability

    configure_logging()
    result = run_stability(
        args.config or str(STABILITY_CONFIG),
        args.overrides,
        args.out,
        [v.strip() for v in args.variants.split(",") if v.strip()],
        seeds=args.seeds,
        budget_minutes=args.budget_minutes,
    )
    if result.report.is_file() and int(os.environ.get("RANK", "0")) == 0:
        print(result.report.read_text())
    return 0


def cmd_convert(args) -> int:
    from megatron_gspo.checkpoint.convert import convert_main

    return convert_main(args.rest)


def cmd_plan(args) -> int:
    from megatron_gspo.planning.cli import plan_main

    return plan_main(args.rest)


def cmd_plot(args) -> int:
    from megatron_gspo.training.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from megatron_gspo.training.stability_benchmark import DEFAULT_SEEDS, DEFAULT_VARIANTS, VARIANTS

    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="GSPO / GRPO RL training")
    _config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="cold-start supervised fine-tuning")
    _config_args(p)
    p.add_argument("--out", required=True, help="model checkpoint directory to write")
    p.set_defaults(func=cmd_sft)
    p = sub.add_parser("eval", help="held-out avg@n / pass@k")
    _config_args(p)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("demo", help="the embedded default: SFT then GSPO on a tiny MoE (CPU, minutes)")
    _config_args(p)
    p.add_argument("--run-dir", default="runs/demo")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("stability", help="GSPO vs GRPO vs GRPO + routing replay over seeds (MoE stability report)")
    _config_args(p)
    p.add_argument("--out", default="runs/stability", help="report directory")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default=str(DEFAULT_SEEDS),
                   help="seed count N (trainer.seed .. trainer.seed + N - 1) or a comma list of seeds")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="start no run that would end past this many minutes (estimate: the longest run so far)")
    p.set_defaults(func=cmd_stability)
    for name, func, text in (
        ("convert", cmd_convert, "HF <-> Megatron checkpoint conversion"),
        ("plan", cmd_plan, "layout / memory planner"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)
    p = sub.add_parser("plot", help="PNG curves of a run directory")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    import warnings

    # megatron-core warns at import about missing TE / apex and deprecated config fields: noise on the CPU path.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    argv = list(sys.argv[1:] if argv is None else argv)
    # convert / plan own their argument parsers (argparse REMAINDER would swallow a leading --flag wrongly).
    passthrough = {"convert": cmd_convert, "plan": cmd_plan}
    if argv and argv[0] in passthrough:
        try:
            return passthrough[argv[0]](argparse.Namespace(rest=argv[1:]))
        except (ValueError, FileNotFoundError) as err:
            print(f"megatron-gspo: error: {err}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    from megatron_gspo.rollout.server.errors import ServerError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"megatron-gspo: error: {err}", file=sys.stderr)
        return 2
    except ServerError as err:  # a rollout server failed (died, refused, answered garbage): say which, in one line
        print(f"megatron-gspo: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
