"""`megatron-gspo stability`: GSPO, GSPO-token, GRPO and GRPO + Routing Replay (R2 / R3) on one MoE model, over
several seeds, with a collapse verdict per run (GSPO paper §5.3; arXiv:2507.18071).

One cold-start SFT model is trained first (or `model.load` is used as given) and every run starts from it, so
runs differ only in the algorithm, the routing replay and the seed (`trainer.seed`: rollout and evaluation
sampling; the prompts and their order are the same for every run). Runs go seed-major (every variant of the
first seed, then the next seed), so a run cut short by `--budget-minutes` still leaves whole seeds to compare.
A finished run directory whose resolved config equals the new one is reused, so a bigger `--seeds` or a new
variant only runs what is missing. The analysis (verdicts, seed aggregation, report.md) is in
benchmarks/stability/report.py, the figures in benchmarks/stability/plots.py.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_gspo.training.config import RunConfig, load_run_config

log = logging.getLogger(__name__)

VARIANTS: dict[str, tuple[str, ...]] = {
    "gspo": ("loss.algorithm=gspo", "moe.routing_replay=off"),
    "gspo_token": ("loss.algorithm=gspo_token", "moe.routing_replay=off"),
    "grpo": ("loss.algorithm=grpo", "moe.routing_replay=off"),
    # R2 records the routes in the trainer's old-policy pass, so pi_old is recomputed there.
    "grpo_r2": ("loss.algorithm=grpo", "moe.routing_replay=r2", "rollout.old_logprobs=recompute"),
    "gspo_r2": ("loss.algorithm=gspo", "moe.routing_replay=r2", "rollout.old_logprobs=recompute"),
    # R3 replays the rollout engine's routes: the in-process engine records them; servers must return them.
    "grpo_r3": ("loss.algorithm=grpo", "moe.routing_replay=r3"),
}
"""Benchmark variants: the overrides each applies on top of the user's config."""
DEFAULT_VARIANTS = ("gspo", "gspo_token", "grpo", "grpo_r2", "grpo_r3")
DEFAULT_SEEDS = 3
_SFT_SECTIONS = ("model", "data", "sft", "parallel")


_ROUTE_FLAGS = ("return_routed_experts", "capture_routes")
"""Server-engine options that make the rollout engine report its routes (rollout/server/config.py; the trainer
fills the routing shape from the model)."""


def variant_overrides(variant: str, base: RunConfig) -> list[str]:
    """The overrides of `variant`. R3 with a server engine needs the servers' routes: with SGLang the variant
    asks for them (`sglang.return_routed_experts=true`) unless the config already does; vLLM has two ways (CPU
    servers: `vllm.capture_routes`, GPU servers: `vllm.return_routed_experts`), so the config must choose one."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown stability variant {variant!r}; choose from {', '.join(VARIANTS)}")
    out = list(VARIANTS[variant])
    engine = base.rollout.engine
    if variant.endswith("_r3") and engine != "local":
        section = getattr(base, engine, None) or {}  # the engine's own config section
        if not any(section.get(flag) for flag in _ROUTE_FLAGS):
            if engine != "sglang":
                raise ValueError(
                    f"variant {variant} replays the rollout engine's routes: set {engine}.capture_routes=true "
                    f"(CPU servers) or {engine}.return_routed_experts=true (GPU servers)"
                )
            out.append("sglang.return_routed_experts=true")
    return out


def parse_seeds(spec: str | int, base_seed: int) -> list[int]:
    """`--seeds`: a count N (seeds base_seed .. base_seed + N - 1) or a comma list of seeds ("3,7")."""
    text = str(spec).strip()
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            count = int(text)
            if count < 1:
                raise ValueError
            seeds = list(range(base_seed, base_seed + count))
    except ValueError:
        raise ValueError(
            f"--seeds={spec!r} must be a count >= 1 or a comma list of seeds (e.g. 3 or 1,2,5)"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds={spec!r} must list distinct seeds >= 0")
    return seeds


@dataclass
class RunSpec:
    """One (variant, seed) run of the benchmark."""

    variant: str
    seed: int
    run_dir: Path
    overrides: list[str]

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"


def plan_runs(
    variants: list[str], seeds: list[int], out: Path, base: RunConfig, extra: list[str]
) -> list[RunSpec]:
    """Seed-major run order: every variant of the first seed, then the next seed."""
    return [
        RunSpec(
            v,
            s,
            out / v / f"seed{s}",
            [
                *variant_overrides(v, base),
                "moe.drift_rollout=true",  # the report's drift per rollout batch; the user's extras may turn it off
                f"trainer.seed={s}",
                *extra,
                f"trainer.run_dir={out / v / f'seed{s}'}",
            ],
        )
        for s in seeds
        for v in variants
    ]


def _finished(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether run_dir holds a finished run of exactly this config (then it is reused)."""
    summary, config = run_dir / "summary.json", run_dir / "config.yaml"
    if not (summary.is_file() and config.is_file() and (run_dir / "metrics.jsonl").is_file()):
        return False
    if yaml.safe_load(config.read_text()) != yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False)):
        return False
    return json.loads(summary.read_text()).get("steps") == cfg.trainer.steps


def print_runs(config: str, overrides: list[str], out_dir: str, variants: list[str], *, seeds: str | int) -> None:
    """The runs `run_stability` would train, one tab-separated line each (variant, seed, run directory, the
    run's own overrides, space-separated: they come after `overrides`), all configs validated first; for a
    scheduler that trains each run as its own job (examples/qwen3_30b_a3b_stability.sh), then `--report-only`."""
    base = load_run_config(config, overrides)
    runs = plan_runs(variants, parse_seeds(seeds, base.trainer.seed), Path(out_dir), base, [])
    for r in runs:
        load_run_config(config, [*overrides, *r.overrides])
    for r in runs:
        print("\t".join((r.variant, str(r.seed), str(r.run_dir), " ".join(r.overrides))))


def report_from_runs(out_dir: str) -> Path:
    """report.md of run directories trained elsewhere, e.g. one cluster job per (variant, seed) (examples/
    qwen3_30b_a3b_stability.sh): every `<out_dir>/<variant>/seed<N>/` holding a run's summary.json and
    metrics.jsonl, whatever config it ran (the launch scripts add their own overrides, so the exact-config reuse
    of `run_stability` cannot apply); unfinished and unknown directories are listed, not reported."""
    from megatron_gspo.benchmarks.stability.report import write_report

    out = Path(out_dir)
    if not out.is_dir():
        raise ValueError(f"--report-only: {out} is not a directory of stability runs (<variant>/seed<N>/)")
    runs: dict[str, dict[int, Path]] = {}
    left: list[str] = []
    for run_dir in sorted(out.glob("*/seed*")):
        variant, seed = run_dir.parent.name, run_dir.name[len("seed"):]
        done = (run_dir / "summary.json").is_file() and (run_dir / "metrics.jsonl").is_file()
        if variant in VARIANTS and seed.isdigit() and done:
            runs.setdefault(variant, {})[int(seed)] = run_dir
        elif run_dir.is_dir():
            left.append(f"{variant}/{run_dir.name}")
    if not runs:
        raise ValueError(
            f"--report-only: no finished run under {out} (expected <variant>/seed<N>/ with summary.json and "
            f"metrics.jsonl; variants: {', '.join(VARIANTS)})"
        )
    header = [
        f"Report of {sum(len(s) for s in runs.values())} finished run(s) found under `{out}` (`--report-only`: "
        "trained elsewhere, each with its own config.yaml)."
    ]
    if left:
        header.append(f"Not reported (unfinished or not a variant): {', '.join(left)}.")
    return write_report(out, runs, header=header)


def train_run(cfg: RunConfig) -> None:
    """One RL run (the default runner)."""
    from megatron_gspo.training.trainer import GSPOTrainer

    trainer = GSPOTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()


def _sft_sections(cfg: RunConfig) -> dict:
    tree = cfg.to_dict()
    return json.loads(
        json.dumps({s: tree[s] for s in _SFT_SECTIONS} | {"seed": tree["trainer"]["seed"]}, default=str)
    )


def shared_sft(base: RunConfig, out: Path) -> Path:
    """The cold-start SFT model every run starts from: trained once, reused while its settings match."""
    from megatron_gspo.training.sft import run_sft

    sft_dir = out / "sft_model"
    settings = sft_dir / "sft_settings.json"
    wanted = _sft_sections(base)
    if (sft_dir / "config.json").is_file():
        if settings.is_file() and json.loads(settings.read_text()) == wanted:
            log.info("stability: reusing the SFT model in %s", sft_dir)
            return sft_dir
        raise ValueError(
            f"{sft_dir} holds an SFT model trained with other model/data/sft settings; use another --out"
        )
    log.info("stability: cold-start SFT -> %s", sft_dir)
    result = run_sft(base, out_dir=str(sft_dir))
    if _is_rank0():
        settings.write_text(json.dumps(wanted, indent=1))
        (sft_dir / "sft_result.json").write_text(json.dumps(result, indent=1))
        (sft_dir / SFT_CODE_FILE).write_text(json.dumps(code_version(), indent=1))
    return sft_dir


SFT_CODE_FILE = "sft_code.json"
"""The code version that trained a shared SFT model (it is reused across code versions while its settings match)."""


def sft_fingerprint(sft_dir: Path) -> dict:
    """What a run row records of the SFT model it started from: its directory, the sha256 of its checkpoint's files
    (model/: megatron's distributed checkpoint; relative path and bytes, in path order) and the code version that
    trained it (None for models trained before that was written)."""
    digest = hashlib.sha256()
    weights = sft_dir / "model"
    for path in sorted(p for p in weights.rglob("*") if p.is_file()):
        digest.update(path.relative_to(weights).as_posix().encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    code = sft_dir / SFT_CODE_FILE
    return {"dir": str(sft_dir), "weights_sha256": digest.hexdigest(),
            "trained_at": json.loads(code.read_text()) if code.is_file() else None}


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def code_version() -> dict:
    """The git commit the benchmark ran (and whether the tree had uncommitted changes), when known."""
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if commit.returncode:
        return {}
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


@dataclass
class BenchmarkResult:
    """What a benchmark invocation did."""

    report: Path
    done: dict[str, dict[int, Path]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def run_stability(
    config: str | None,
    overrides: list[str],
    out_dir: str,
    variants: list[str] | None = None,
    *,
    seeds: str | int = DEFAULT_SEEDS,
    budget_minutes: float | None = None,
    runner: Callable[[RunConfig], None] = train_run,
    clock: Callable[[], float] = time.monotonic,
    note: str | None = None,
) -> BenchmarkResult:
    """SFT once (unless model.load is set), then every (variant, seed) run in seed-major order, then the report.

    `note`: a line for the report's header (e.g. what the default setting is and why: drivers.DEFAULT_LABEL).
    `budget_minutes` bounds the whole invocation: a run starts only while the elapsed time plus the longest run
    so far (0 before the first) fits in it; runs that do not fit are listed as skipped in the report.
    """
    from megatron_gspo.benchmarks.stability.report import write_report

    variants = list(variants or DEFAULT_VARIANTS)
    if len(set(variants)) != len(variants):
        raise ValueError(f"--variants lists a variant twice: {','.join(variants)}")
    if budget_minutes is not None and budget_minutes <= 0:
        raise ValueError(f"--budget-minutes={budget_minutes} must be > 0")
    if budget_minutes is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "--budget-minutes runs in one process only (ranks could disagree on when to stop); "
            "bound trainer.steps and --seeds instead"
        )
    base = load_run_config(config, overrides)
    seed_list = parse_seeds(seeds, base.trainer.seed)
    for v in variants:
        variant_overrides(v, base)  # unknown variants fail before any training
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = clock()
    started_at = datetime.datetime.now().isoformat(timespec="seconds")
    code = code_version()  # at the start: the code this invocation imports and runs
    extra, sft = [], None
    if base.model.load is None:
        sft_dir = shared_sft(base, out)
        extra, sft = [f"model.load={sft_dir}"], sft_fingerprint(sft_dir)
    runs = plan_runs(variants, seed_list, out, base, extra)
    configs = [load_run_config(config, [*overrides, *r.overrides]) for r in runs]  # all validated up front
    result = BenchmarkResult(report=out / "report.md")
    durations: list[float] = []
    records = []
    for i, (spec, cfg) in enumerate(zip(runs, configs), start=1):
        elapsed = clock() - start
        if _finished(spec.run_dir, cfg):
            log.info(
                "stability [%d/%d] %s: reusing the finished run in %s", i, len(runs), spec.name, spec.run_dir
            )
            status, seconds = "reused", 0.0
        elif budget_minutes is not None and elapsed + max(durations, default=0.0) > 60 * budget_minutes:
            log.warning(
                "stability [%d/%d] %s: skipped, it would end past the budget of %g min (elapsed %s)",
                i,
                len(runs),
                spec.name,
                budget_minutes,
                _minutes(elapsed),
            )
            result.skipped.append(spec.name)
            records.append({"variant": spec.variant, "seed": spec.seed, "status": "skipped", "seconds": 0.0})
            continue
        else:
            left = (
                "" if budget_minutes is None else f", budget left {_minutes(60 * budget_minutes - elapsed)}"
            )
            log.info(
                "stability [%d/%d] variant=%s seed=%d: starting (elapsed %s%s)",
                i,
                len(runs),
                spec.variant,
                spec.seed,
                _minutes(elapsed),
                left,
            )
            t0 = clock()
            runner(cfg)
            seconds = clock() - t0
            durations.append(seconds)
            status = "ran"
            log.info("stability [%d/%d] %s: finished in %s", i, len(runs), spec.name, _minutes(seconds))
        result.done.setdefault(spec.variant, {})[spec.seed] = spec.run_dir
        records.append({"variant": spec.variant, "seed": spec.seed, "status": status, "seconds": seconds})
    if _is_rank0():
        total = clock() - start
        meta = {
            "command": sys.argv,
            "config": config,
            "overrides": list(overrides),
            "variants": variants,
            "seeds": seed_list,
            "budget_minutes": budget_minutes,
            "code": code,
            "sft_model": sft,
            "started": started_at,
            "seconds": total,
            "runs": records,
            "skipped": result.skipped,
        }
        (out / "benchmark.json").write_text(json.dumps(meta, indent=1))
        code = meta["code"]
        header = [
            f"Config `{config}`{' with ' + ' '.join(overrides) if overrides else ''}; seeds {seed_list} "
            f"(trainer.seed); {base.trainer.steps} RL steps per run; {sum(r['status'] == 'ran' for r in records)} "
            f"run(s) trained and {sum(r['status'] == 'reused' for r in records)} reused in {_minutes(total)} "
            "(wall time of this invocation).",
            f"Code of the runs trained by this invocation: {code.get('commit', 'unknown')}"
            f"{' (uncommitted changes)' if code.get('dirty') else ''}.",
        ]
        if note:
            header.append(note)
        write_report(out, result.done, skipped=result.skipped, header=header)
        log.info("stability report written to %s (%s)", result.report, _minutes(total))
    return result
