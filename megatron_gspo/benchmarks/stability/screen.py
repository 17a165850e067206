"""`megatron-gspo stability-screen`: the screening pass of the driver map (issue 29): one seed, short runs, every
(cell, variant) of a list, one row per run appended to a jsonl file.

Each run is `megatron-gspo train` in a child process (its own memory and process group: a run can be stopped
without stopping the screen) from the cold-start SFT model of its cell (benchmarks/stability/drivers.py: cells that
keep the preset's architecture and task share one). The screen reads the child's metrics.jsonl as it grows and
stops it (SIGTERM: the trainer stops after the step, with a checkpoint) when
- the collapse verdict is certain (`certain_collapse`): status "early_stop";
- the deadline (`--stop-at`) or the run's time limit passes: status "cut", the verdict of the steps it ran.
A row holds the cell, variant, seed, the collapse verdict and the means of the stability and R3 metrics
(report.summarise_run), the code version, the screen's command line and the run's own. Resumable: a (cell,
variant, seed) whose last row is "finished" or "early_stop" with the same resolved config is not run again; a
"cut" or "failed" one is run again from scratch.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_gspo.benchmarks.stability.benchmark import (
    VARIANTS,
    code_version,
    sft_fingerprint,
    shared_sft,
    variant_overrides,
)
from megatron_gspo.benchmarks.stability.drivers import SCREEN_CELLS, cell_overrides, model_cell
from megatron_gspo.benchmarks.stability.report import REWARD_FLOOR, REWARD_WINDOW, json_safe, summarise_run
from megatron_gspo.metrics.plot import read_jsonl
from megatron_gspo.training.config import load_run_config

log = logging.getLogger(__name__)

DEFAULT_VARIANTS = ("grpo", "gspo")
DONE = ("finished", "early_stop")
"""Row statuses a resumed screen does not run again."""
ROOT = Path(__file__).resolve().parents[3]


def certain_collapse(rewards: Sequence[float], window: int = REWARD_WINDOW) -> bool:
    """Whether a run's collapse verdict is settled before its end: its best `window`-step moving average reached
    the reward rule's floor, and then every sampled response of `window` consecutive steps scored exactly 0.

    Then every group has zero variance, every advantage is 0 and the policy gradient vanishes: only the optimizer's
    momentum and the load-balancing loss still move the weights, and the run ends below half its best (a reward
    collapse by report.py's rule) unless sampling finds the answers again. A rule of practice, not a proof; the
    row says "early_stop" so a reader can tell it from a run that went to its end."""
    if len(rewards) < 2 * window:
        return False
    head = rewards[:-window]
    best = max(sum(head[i - window : i]) / window for i in range(window, len(head) + 1))
    return best >= REWARD_FLOOR and all(r == 0 for r in rewards[-window:])


@dataclass
class ScreenPlan:
    """What one `stability-screen` invocation runs (validated before anything runs)."""

    config: str
    overrides: list[str] = field(default_factory=list)
    cells: list[str] = field(default_factory=lambda: list(SCREEN_CELLS))
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    seed: int = 1234
    steps: int = 30
    out: str = "runs/stability_screen"
    """Run directories and SFT models (large: not committed)."""
    rows: str = "results/stability_moe/screen.jsonl"
    """The rows (committed)."""
    stop_at: datetime.datetime | None = None
    """No run goes past this moment (UTC): the running one is cut, no other starts."""
    run_minutes: float = 60.0
    """A run still going after this long is cut."""

    def __post_init__(self) -> None:
        if not self.cells or len(set(self.cells)) != len(self.cells):
            raise ValueError(f"--cells={','.join(self.cells)} must list distinct cells")
        for cell in self.cells:
            cell_overrides(cell)  # unknown drivers, clashing keys
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"--variants: unknown variant {unknown[:1]}; choose from {', '.join(VARIANTS)}")
        if self.steps < 2 * REWARD_WINDOW:
            raise ValueError(f"--steps={self.steps} must be >= {2 * REWARD_WINDOW} (the collapse rule's windows)")
        if not self.run_minutes > 0:
            raise ValueError(f"--run-minutes={self.run_minutes} must be > 0")

    def run_overrides(self, cell: str, variant: str) -> list[str]:
        """The train overrides of one run, without model.load and run_dir (added where they are known)."""
        base = load_run_config(self.config, [*self.overrides, *cell_overrides(cell)])
        return [
            *self.overrides,
            *cell_overrides(cell),
            *variant_overrides(variant, base),
            f"trainer.seed={self.seed}",
            f"trainer.steps={self.steps}",
            "trainer.progress=false",
            "trainer.save_final=false",
        ]


def parse_stop_at(text: str | None, now: datetime.datetime | None = None) -> datetime.datetime | None:
    """`--stop-at`: HH:MM (UTC, the next such moment: 01:05 given at 22:53 is tomorrow's) or an ISO date-time (UTC
    unless it says otherwise)."""
    if text is None:
        return None
    now = now or datetime.datetime.now(datetime.timezone.utc)
    try:
        if len(text) <= 5 and ":" in text:
            hh, mm = (int(x) for x in text.split(":"))
            moment = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
            return moment if moment > now else moment + datetime.timedelta(days=1)
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--stop-at={text!r} must be HH:MM (UTC) or an ISO date-time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)


def config_digest(config: str, overrides: Sequence[str]) -> str:
    """Digest of a resolved run config (the same settings written any way give the same digest)."""
    tree = load_run_config(config, list(overrides)).to_dict()
    tree["trainer"].pop("run_dir")
    tree["model"].pop("load")
    text = yaml.safe_dump(tree, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def last_rows(path: Path) -> dict[tuple[str, str, int], dict]:
    """The last row of each (cell, variant, seed) in a screen.jsonl."""
    out: dict[tuple[str, str, int], dict] = {}
    if not path.is_file():
        return out
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out[(row["cell"], row["variant"], int(row["seed"]))] = row
        except (ValueError, KeyError) as err:
            raise ValueError(f"{path}:{number}: not a screen row ({err}); fix or delete that line") from None
    return out


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _rewards(run_dir: Path) -> list[float]:
    try:
        return [float(r["reward_mean"]) for r in read_jsonl(run_dir / "metrics.jsonl")]
    except ValueError:  # a line being written
        return []


def watch_run(cmd: list[str], run_dir: Path, log_path: Path, *, stop_at, run_minutes: float, poll_s: float = 5.0):
    """Runs `cmd` (a train run writing run_dir) in its own process group; stops it early when the collapse is
    certain or time is up. Returns (status, seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    start = time.monotonic()
    status = None
    with open(log_path, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                time.sleep(poll_s)
                if status is not None:
                    continue  # stopping: wait for the step to end
                late = stop_at is not None and _now() >= stop_at
                if late or time.monotonic() - start > 60 * run_minutes:
                    status = "cut"
                elif certain_collapse(_rewards(run_dir)):
                    status = "early_stop"
                if status is not None:
                    log.info("screen: %s -> SIGTERM (%s)", run_dir, status)
                    os.killpg(proc.pid, signal.SIGTERM)
                    deadline = time.monotonic() + 180
                    while proc.poll() is None and time.monotonic() < deadline:
                        time.sleep(1)
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:  # the screen itself is being stopped: take the run down with it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - start
    if status is None:
        status = "finished" if proc.returncode == 0 else "failed"
    return status, seconds


def _row(plan: ScreenPlan, cell: str, variant: str, status: str, seconds: float, digest: str, cmd, run_dir, code,
         sft_dir: Path | None = None):
    row: dict = {
        "cell": cell,
        "variant": variant,
        "seed": plan.seed,
        "status": status,
        "steps_planned": plan.steps,
        "config_digest": digest,
        "seconds": round(seconds, 1),
        "code": code,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "run_command": [Path(cmd[0]).name, *cmd[1:]],
        "run_dir": str(run_dir),
        "time": _now().isoformat(timespec="seconds"),
        # model.load given by the user: its path is in run_command; a shared SFT model is reused across code
        # versions, so which weights and which code made them are recorded.
        "sft_model": sft_fingerprint(sft_dir) if sft_dir is not None else None,
    }
    if (run_dir / "metrics.jsonl").is_file():
        summary = summarise_run(run_dir)
        verdict = summary.pop("verdict")
        row.update(verdict=verdict.label(), collapsed=verdict.collapsed, collapse_step=verdict.step)
        row.update(summary)
    return json.loads(json.dumps(json_safe(row)))  # the row as the file holds it (layer keys are strings)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def write_screen_table(rows_path: Path) -> Path:
    """screen.md beside the rows: the last row of each (cell, variant, seed), in the order first run."""
    rows = last_rows(rows_path)
    lines = [
        f"# Collapse-driver runs ({rows_path.name}: {len(rows)} runs; cells "
        f"{', '.join(dict.fromkeys(cell for cell, _, _ in rows))}; "
        f"seeds {', '.join(str(seed) for seed in sorted({seed for _, _, seed in rows}))})",
        "",
        "Rows are appended by `megatron-gspo stability-screen` (command and code version in each row). Verdicts by "
        "the collapse rule of report.md; `early_stop`: stopped once the collapse was certain; `cut`: stopped by "
        "the deadline, verdict of the steps run. KL: k3 train / inference KL (mean / max over steps); F(2): share "
        "of response tokens with pi_train / pi_rollout > 2; router flips: share of response tokens the engine "
        "routes to another top-k set than the trainer in >= 1 layer, and the largest per-layer share. With pi_old "
        "from the engine (rollout.old_logprobs=engine) KL and F(2) are not measured ('-': the correction would "
        "compare the engine with itself); engine-ratio KL is then the mismatch: the loss's approx_kl of the first "
        "minibatch against the engine's log-probs (k3 for GRPO, k1 for GSPO's sequence sums).",
        "",
        "| cell | variant | seed | status | steps | verdict | best reward | final reward | held-out before -> after "
        "| KL mean / max | engine-ratio KL | F(2) | router flips >= 1 layer / max layer (%) | drift / step (%) | clip tok low / high "
        "| s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        layers = [v for v in (r.get("router_flips_per_layer") or {}).values() if v is not None]
        lines.append(
            f"| {r['cell']} | {r['variant']} | {r['seed']} | {r['status']} | {r.get('steps', 0)}/{r['steps_planned']} "
            f"| {r.get('verdict', '-')} | {_fmt(r.get('best_reward'), '.3f')} | {_fmt(r.get('final_reward'), '.3f')} "
            f"| {_fmt(r.get('eval_before'), '.3f')} -> {_fmt(r.get('eval_after'), '.3f')} "
            f"| {_fmt(r.get('mismatch_kl'), '.1e')} / {_fmt(r.get('mismatch_kl_max'), '.1e')} "
            f"| {_fmt(r.get('engine_ratio_kl'), '.1e')} | {_fmt(r.get('frac_ratio_above_2'), '.1e')} "
            f"| {_fmt(r.get('router_flips_any_layer'), '.1f', 100)} / {_fmt(max(layers, default=None), '.1f', 100)} "
            f"| {_fmt(r.get('expert_drift'), '.2f', 100)} "
            f"| {_fmt(r.get('clip_low_tok'), '.1e')} / {_fmt(r.get('clip_high_tok'), '.1e')} | {r['seconds']:.0f} |"
        )
    path = rows_path.with_suffix(".md")
    path.write_text("\n".join(lines) + "\n")
    return path


def run_screen(plan: ScreenPlan, runner=watch_run) -> list[dict]:
    """Every (cell, variant) of the plan not already done; returns the rows appended. `runner(cmd, run_dir,
    log_path, stop_at=, run_minutes=)` -> (status, seconds) runs one train command (default `watch_run`)."""
    rows_path, out = Path(plan.rows), Path(plan.out)
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    code = code_version()
    done = last_rows(rows_path)
    written = []
    for cell in plan.cells:
        for variant in plan.variants:
            if plan.stop_at is not None and _now() >= plan.stop_at:
                log.info("screen: past --stop-at, no further run starts")
                return written
            overrides = plan.run_overrides(cell, variant)
            digest = config_digest(plan.config, overrides)
            prev = done.get((cell, variant, plan.seed))
            if prev and prev["status"] in DONE and prev.get("config_digest") == digest:
                log.info("screen: %s / %s done (%s), skipped", cell, variant, prev.get("verdict"))
                continue
            # The cold-start model: one per architecture / task (drivers.py new_model), shared by the cells that
            # add drivers keeping it (engine_bf16+long_answers starts from long_answers' model).
            sft_name = model_cell(cell)
            own = cell_overrides(sft_name) if sft_name != "preset" else []
            sft_cfg = load_run_config(plan.config, [*plan.overrides, *own])
            sft_dir = shared_sft(sft_cfg, out / "sft" / sft_name) if sft_cfg.model.load is None else None
            # The digest in the name: a screen of other settings (--steps) never replaces this one's run.
            run_dir = out / "runs" / cell / variant / f"seed{plan.seed}_{digest}"
            if run_dir.exists():
                shutil.rmtree(run_dir)  # a cut or failed run starts again from scratch
            run_dir.mkdir(parents=True)
            cmd = [sys.executable, "-m", "megatron_gspo.cli.main", "train", "--config", plan.config, *overrides]
            if sft_dir is not None:
                cmd.append(f"model.load={sft_dir}")
            cmd.append(f"trainer.run_dir={run_dir}")
            log.info("screen: %s / %s starting: %s", cell, variant, " ".join(cmd[3:]))
            status, seconds = runner(
                cmd,
                run_dir,
                run_dir.with_name(run_dir.name + ".log"),
                stop_at=plan.stop_at,
                run_minutes=plan.run_minutes,
            )
            row = _row(plan, cell, variant, status, seconds, digest, cmd, run_dir, code, sft_dir)
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            written.append(row)
            write_screen_table(rows_path)
            log.info("screen: %s / %s %s in %.0f s: %s", cell, variant, status, seconds, row.get("verdict"))
    return written
