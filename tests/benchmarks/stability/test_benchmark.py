"""`megatron-gspo stability` end to end on the benchmark's example config, shrunk to 2 RL steps: SFT, every
(variant, seed) run with progress, the report with its tables and figures."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SMALL = [
    "model.overrides.num_hidden_layers=2",
    "trainer.steps=2",
    "trainer.prompts_per_step=8",
    "trainer.micro_batch_size=16",
    "trainer.progress=false",
    "data.train_size=256",
    "data.heldout_size=16",
    "eval.max_prompts=16",
    "eval.n=2",
    "eval.every=1",
    "sft.max_steps=2",
    "sft.batch_size=16",
    "sft.eval_every=2",
    "sft.eval_prompts=16",
    "sft.target_accuracy=0",
]


@pytest.mark.slow
def test_two_step_benchmark_writes_the_report(tmp_path):
    out = tmp_path / "stability"
    cmd = [
        sys.executable,
        "-m",
        "megatron_gspo.cli.main",
        "stability",
        "--config",
        "examples/stability_moe.yaml",
        "--out",
        str(out),
        "--variants",
        "grpo_r2,grpo_r3",
        "--seeds",
        "2",
        "--budget-minutes",
        "60",
        *SMALL,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    log = res.stdout + res.stderr
    for i, name in enumerate(
        (
            "variant=grpo_r2 seed=1234",
            "variant=grpo_r3 seed=1234",
            "variant=grpo_r2 seed=1235",
            "variant=grpo_r3 seed=1235",
        ),
        start=1,
    ):
        assert f"stability [{i}/4] {name}: starting" in log  # seed-major progress
    report = (out / "report.md").read_text()
    assert json.loads((out / "sft_model" / "sft_code.json").read_text()).keys() == {"commit", "dirty"}
    meta = json.loads((out / "benchmark.json").read_text())
    assert meta["sft_model"]["trained_at"]["commit"]
    assert meta["sft_model"]["weights_sha256"] != hashlib.sha256().hexdigest()  # weight files were hashed
    assert "## Variants (mean ± std over seeds)" in report and "| grpo_r2 | 2 | " in report
    for variant in ("grpo_r2", "grpo_r3"):
        for seed in (1234, 1235):
            assert f"| {variant} | {seed} | " in report
            rows = [json.loads(line) for line in (out / variant / f"seed{seed}" / "metrics.jsonl").open()]
            assert [r["step"] for r in rows] == [1, 2]
            # Per-layer drift for the figures, both MoE layers.
            assert {"expert_drift_layer0", "expert_drift_layer1"} <= set(rows[-1])
            # Step 1's first update runs at lr 0 (warm-up over 4 optimizer steps): no per-step drift, but the
            # routing after all 4 steps of the rollout batch has moved.
            assert rows[0]["expert_drift"] == 0.0 and rows[0]["expert_drift_rollout"] > 0.0
            assert {"expert_drift_rollout_layer0", "expert_drift_rollout_tokens_changed"} <= set(rows[0])
            evals = [
                json.loads(line)["step"] for line in (out / variant / f"seed{seed}" / "eval.jsonl").open()
            ]
            assert evals == [0, 1, 2]  # eval.every=1: before RL, after step 1, after the last step
    for png in (
        "reward",
        "heldout_accuracy",
        "expert_drift",
        "drift_per_layer",
        "clip_fractions",
        "train_inference_mismatch",
    ):
        assert f"](plots/{png}.png)" in report and (out / "plots" / f"{png}.png").stat().st_size > 5000
    meta = json.loads((out / "benchmark.json").read_text())
    assert meta["seeds"] == [1234, 1235] and [r["status"] for r in meta["runs"]] == ["ran"] * 4
    assert (out / "sft_model" / "config.json").is_file()
