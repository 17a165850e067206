"""`megatron-gspo` command line: train | sft | eval | demo | stability | stability-screen | convert | plan | plot.

Exit codes: 0 done; 1 the run failed (one line says why: failing rewards, a dead policy, a full disk, a collective
that timed out); 2 bad input (a config key, a file, a checkpoint); 75 stopped by SIGTERM / SIGUSR1 after writing a
checkpoint (continue with --resume; the Slurm scripts requeue on it); 130 interrupted by Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_gspo.yaml"
STABILITY_CONFIG = DEMO_CONFIG.parent / "stability_moe.yaml"

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130


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

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"--out {out} already exists; remove it, choose another directory or pass --overwrite")
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

    from megatron_gspo.cli.cold_start import sft_then_rl
    from megatron_gspo.training.config import load_run_config
    from megatron_gspo.training.runtime import configure_logging

    configure_logging()
    run_dir = Path(args.run_dir)
    if args.multi_turn:
        from megatron_gspo.cli.demo_multiturn import run_multiturn_demo

        run_multiturn_demo(args.config, run_dir, args.overrides, args.tool_share,
                           lambda d: _clear_demo(d, args.overwrite))
        return 0
    start = time.time()
    # A bad config fails before the run directory is cleared.
    load_run_config(args.config or DEMO_CONFIG, [f"trainer.run_dir={run_dir}", *args.overrides])
    _clear_demo(run_dir, args.overwrite)
    sft, trainer, summary, rl_cfg = sft_then_rl(args.config or DEMO_CONFIG, run_dir, args.overrides)
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


DEMO_OUTPUTS = ("sft_model", "sft_data", "metrics.jsonl", "eval.jsonl", "summary.json", "checkpoints", "tensorboard",
                "plots", "config.yaml")
"""What a demo writes into its run directory (and `demo --overwrite` removes before it starts again)."""


def _clear_demo(run_dir: Path, overwrite: bool) -> None:
    import shutil

    from megatron_gspo.lifecycle.run_dir import check_new_run_dir

    if not overwrite:
        if (run_dir / "sft_model").exists():
            raise FileExistsError(f"--run-dir {run_dir} holds a previous demo: pass --overwrite or another --run-dir")
        check_new_run_dir(run_dir)
        return
    for name in DEMO_OUTPUTS:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def cmd_stability(args) -> int:
    from megatron_gspo.benchmarks.stability.benchmark import run_stability
    from megatron_gspo.training.runtime import configure_logging

    configure_logging()
    if args.report_only:
        from megatron_gspo.benchmarks.stability.benchmark import report_from_runs

        print(report_from_runs(args.out).read_text())
        return 0
    from megatron_gspo.benchmarks.stability import drivers

    cell, note = [], None
    if args.cell is None and args.config is None:  # the CPU preset: the map's most discriminating cell
        cell = [*drivers.cell_overrides(drivers.DEFAULT_CELL), f"trainer.steps={drivers.DEFAULT_STEPS}"]
        note = drivers.DEFAULT_LABEL
    elif args.cell:
        cell = drivers.cell_overrides(args.cell)
    if args.print_runs:
        from megatron_gspo.benchmarks.stability.benchmark import print_runs

        print_runs(args.config or str(STABILITY_CONFIG), [*cell, *args.overrides], args.out,
                   [v.strip() for v in args.variants.split(",") if v.strip()], seeds=args.seeds)
        return 0
    result = run_stability(
        args.config or str(STABILITY_CONFIG),
        [*cell, *args.overrides],
        args.out,
        [v.strip() for v in args.variants.split(",") if v.strip()],
        seeds=args.seeds,
        budget_minutes=args.budget_minutes,
        note=note,
    )
    if result.report.is_file() and int(os.environ.get("RANK", "0")) == 0:
        print(result.report.read_text())
    return 0


def cmd_stability_screen(args) -> int:
    from megatron_gspo.benchmarks.stability.screen import ScreenPlan, parse_stop_at, run_screen
    from megatron_gspo.training.runtime import configure_logging

    configure_logging()
    plan = ScreenPlan(
        config=args.config or str(STABILITY_CONFIG),
        overrides=list(args.overrides),
        cells=[c.strip() for c in args.cells.split(",") if c.strip()],
        variants=[v.strip() for v in args.variants.split(",") if v.strip()],
        seed=args.seed,
        steps=args.steps,
        out=args.out,
        rows=args.rows,
        stop_at=parse_stop_at(args.stop_at),
        run_minutes=args.run_minutes,
    )
    for row in run_screen(plan):
        print(json.dumps({k: row.get(k) for k in ("cell", "variant", "status", "verdict", "steps", "seconds")}))
    return 0


def cmd_convert(args) -> int:
    from megatron_gspo.checkpoint.convert import convert_main

    return convert_main(args.rest)


def cmd_plan(args) -> int:
    from megatron_gspo.planning.cli import plan_main

    return plan_main(args.rest)


def cmd_plot(args) -> int:
    from megatron_gspo.metrics.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from megatron_gspo.benchmarks.stability.benchmark import DEFAULT_SEEDS, DEFAULT_VARIANTS, VARIANTS

    parser = argparse.ArgumentParser(prog="megatron-gspo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="GSPO / GRPO RL training")
    _config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="cold-start supervised fine-tuning")
    _config_args(p)
    p.add_argument("--out", required=True, help="model checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out once the new one is complete")
    p.set_defaults(func=cmd_sft)
    p = sub.add_parser("eval", help="held-out avg@n / pass@k")
    _config_args(p)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("demo", help="the embedded default: SFT then GSPO on a tiny MoE (CPU, minutes)")
    _config_args(p)
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--overwrite", action="store_true", help="replace a previous demo in --run-dir")
    p.add_argument("--multi-turn", action="store_true",
                   help="the calculator-tool demo (examples/tiny_moe_calculator.yaml): multi-turn GSPO")
    p.add_argument("--tool-share", type=float, default=0.25,
                   help="--multi-turn: share of the cold-start SFT transcripts that use the tool")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("stability", help="GSPO vs GRPO vs GRPO + routing replay over seeds (MoE stability report)")
    _config_args(p)
    p.add_argument("--out", default="runs/stability", help="report directory")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default=str(DEFAULT_SEEDS),
                   help="seed count N (trainer.seed .. trainer.seed + N - 1) or a comma list of seeds")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="start no run that would end past this many minutes (estimate: the longest run so far)")
    p.add_argument("--cell", default=None,
                   help="collapse drivers applied before the overrides (benchmarks/stability/drivers.py), e.g. "
                        "engine_bf16+k8; default without --config: engine_bf16+k8 at 20 RL steps, the most "
                        "discriminating setting the CPU map found (labelled so in the report); baseline: none")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report the finished runs under --out/<variant>/seed<N>/ (e.g. one cluster "
                        "job per run, examples/qwen3_30b_a3b_stability.sh)")
    p.add_argument("--print-runs", action="store_true",
                   help="train nothing: print one line per run (variant, seed, run directory, its overrides; tab-"
                        "separated) for a scheduler to submit, as examples/qwen3_30b_a3b_stability.sh does")
    p.set_defaults(func=cmd_stability)
    from megatron_gspo.benchmarks.stability.drivers import SCREEN_CELLS

    p = sub.add_parser("stability-screen", help="screening pass of the collapse-driver map (one seed, short runs)")
    _config_args(p)
    p.add_argument("--cells", default=",".join(SCREEN_CELLS),
                   help="comma list of cells: drivers of benchmarks/stability/drivers.py joined by '+'")
    p.add_argument("--variants", default="grpo,gspo", help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--seed", type=int, default=1234, help="trainer.seed of every run")
    p.add_argument("--steps", type=int, default=30, help="RL steps per run")
    p.add_argument("--out", default="runs/stability_screen", help="run directories and SFT models")
    p.add_argument("--rows", default="results/stability_moe/screen.jsonl", help="rows appended here (resumable)")
    p.add_argument("--stop-at", default=None, help="HH:MM UTC (or ISO time): cut the running run, start no other")
    p.add_argument("--run-minutes", type=float, default=60.0, help="cut a run still going after this long")
    p.set_defaults(func=cmd_stability_screen)
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
        return run_command(passthrough[argv[0]], argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    return _record_exit(run_command(args.func, args))


# The signal a StopRequested named (run_command), for the rank's record: the ranks agree on it (SIGTERM wins).
_stopped_by: list[str] = []


def _record_exit(code: int) -> int:
    """Writes this rank's exit code to $MG_STATUS_DIR/rank-$RANK when the launch scripts ask for it: torchrun
    reports workers that stopped with 75 as failed (1) and srun reports the highest code of its tasks, so only the
    ranks themselves can tell the job "every rank stopped with a checkpoint" (requeue) from a failure. A 75 is
    followed by the signal that stopped the run ("75 SIGTERM"): a SIGTERM that reached only the job's steps
    (`scancel --signal=TERM`, no signal to the batch shell) must not requeue the job either."""
    directory = os.environ.get("MG_STATUS_DIR")
    if directory:
        record = f"{code} {_stopped_by[-1]}" if code == EXIT_STOPPED and _stopped_by else str(code)
        try:
            Path(directory, f"rank-{os.environ.get('RANK', '0')}").write_text(f"{record}\n")
        except OSError:  # a full disk: no record reads as "did not stop cleanly", which is the safe side
            pass
    return code


def run_command(func, args) -> int:
    """Runs a subcommand; every way it can end other than a bug is one line on stderr and an exit code."""
    from megatron_gspo.errors import RunFailure, StopRequested, describe
    from megatron_gspo.rollout.server.errors import ServerError

    try:
        return func(args)
    except StopRequested as stop:
        _say(str(stop))
        _stopped_by.append(stop.signal_name)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        _say("interrupted (Ctrl-C); the checkpoints written so far are complete (continue a run with --resume)")
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as err:
        _say(f"error: {err}")
        return EXIT_BAD_INPUT
    except RunFailure as err:
        _say(f"error: {err}")
        return EXIT_FAILED
    except ServerError as err:  # a rollout server failed (died, refused, answered garbage): say which, in one line
        _say(f"error: {' '.join(str(err).split())}")
        return EXIT_FAILED
    except OSError as err:  # a full disk, a permission denied, ...
        _say(f"error: {describe(err)}")
        return EXIT_FAILED
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if _is_collective_error(err):
            _say(
                f"error: a collective failed ({describe(err)}): another rank failed or is stuck (see its log); "
                "parallel.timeout_s sets how long ranks wait for each other"
            )
            return EXIT_FAILED
        if type(err).__name__ == "CheckpointException":
            _say(f"error: {describe(err)}")
            return EXIT_FAILED
        raise


def _say(message: str) -> None:
    # One write of the whole line: the ranks of a stopped run report at the same moment into one stream, and
    # print()'s separate writes of text and newline would interleave their lines.
    sys.stderr.write(f"megatron-gspo: {message}\n")
    sys.stderr.flush()


_COLLECTIVE_MARKERS = ("third_party/gloo", "NCCL", "ProcessGroup", "c10d")
"""In the message of a RuntimeError from a collective (gloo's timeouts and lost peers are plain RuntimeErrors)."""


def _is_collective_error(err: BaseException) -> bool:
    torch = sys.modules.get("torch")  # only when the error can come from torch.distributed at all
    dist_error = getattr(getattr(torch, "distributed", None), "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _COLLECTIVE_MARKERS)


if __name__ == "__main__":
    sys.exit(main())
