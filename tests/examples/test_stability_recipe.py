"""examples/qwen3_30b_a3b_stability.sh: one Slurm job per (variant, seed) of the stability benchmark on the GPU
recipe, then a report job. Run here in its dry-run mode (DRY_RUN=1 prints each sbatch command instead of
submitting: the jobs train a 30B model on 4 GPU nodes); the run list it submits comes from the real CLI
(`megatron-gspo stability --print-runs`) on the real example config; the report job's command
(`--report-only`) is tested in tests/benchmarks/stability/test_report.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_gspo.benchmarks.stability.benchmark import VARIANTS
from megatron_gspo.training.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen3_30b_a3b_stability.sh"
CONFIG = ROOT / "examples" / "qwen3_30b_a3b_gspo.yaml"


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_one_job_per_variant_and_seed_then_a_report_after_all_of_them(tmp_path):
    out = _dry_run(tmp_path, SEEDS="7,8", DRIVERS="trainer.minibatches=8 rollout.old_logprobs=engine")
    assert out.returncode == 0, out.stderr
    lines = [shlex.split(x) for x in out.stderr.splitlines() if x.startswith("env ")]
    jobs, report = lines[:-1], lines[-1]
    assert len(jobs) == 4 * 2  # gspo, grpo, grpo_r2, grpo_r3 x seeds 7, 8
    seen = set()
    for words in jobs:
        env = dict(w.split("=", 1) for w in words[1 : words.index("sbatch")])
        assert words[-1] == str(ROOT / "launch" / "train.sbatch") and "--nodes=4" in words
        assert env["CONFIG"] == str(CONFIG)
        variant, seed = Path(env["RUN_DIR"]).parent.name, Path(env["RUN_DIR"]).name
        seen.add((variant, seed))
        overrides = env["TRAIN_OVERRIDES"].split()
        assert overrides[:2] == ["trainer.minibatches=8", "rollout.old_logprobs=engine"]  # the drivers first
        assert set(VARIANTS[variant]) <= set(overrides)  # the variant's algorithm / replay / pi_old win after them
        assert f"trainer.seed={seed.removeprefix('seed')}" in overrides
        assert f"trainer.run_dir={env['RUN_DIR']}" in overrides
        # What the job's `megatron-gspo train` will load: a valid config with the variant's settings.
        cfg = load_run_config(CONFIG, overrides)
        assert cfg.loss.algorithm == ("gspo" if variant == "gspo" else "grpo") and cfg.trainer.minibatches == 8
        assert cfg.rollout.old_logprobs == ("recompute" if variant == "grpo_r2" else "engine")
    assert seen == {(v, f"seed{s}") for v in ("gspo", "grpo", "grpo_r2", "grpo_r3") for s in (7, 8)}
    assert "--dependency=afterany:" + ":".join(str(i) for i in range(1, 9)) in report
    wrap = next(w for w in report if w.startswith("--wrap="))
    assert shlex.split(wrap.removeprefix("--wrap="))[-4:] == ["stability", "--report-only", "--out", str(tmp_path / "out")]


def test_a_bad_driver_submits_nothing(tmp_path):
    out = _dry_run(tmp_path, DRIVERS="trainer.minibatchez=8")
    assert out.returncode == 2 and "sbatch" not in out.stderr
    assert "minibatchez" in out.stderr
