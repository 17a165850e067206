"""Multi-turn GSPO end to end: `megatron-gspo train` on the calculator config (1 process and DP=2 with torchrun),
the `demo --multi-turn` command on tiny numbers, and the config rule that a trajectory fits a training sequence."""

import json
import subprocess
import sys

import pytest

from megatron_gspo.training.config import load_run_config
from tests.training.test_end_to_end import ROOT, _env, _rows

CONFIG = "examples/tiny_moe_calculator.yaml"
MINI = ["trainer.steps=2", "trainer.prompts_per_step=8", "trainer.micro_batch_size=16", "trainer.progress=false",
        "rollout.group_size=4", "data.train_size=256", "data.heldout_size=16", "eval.max_prompts=16", "eval.n=2"]


def _run(args, nproc=1):
    base = [sys.executable, "-m", "megatron_gspo.cli.main"]
    if nproc > 1:
        base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
                "megatron_gspo.cli.main"]
    res = subprocess.run(base + args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def _evals(run_dir):
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_multiturn_train_run(tmp_path, nproc):
    run_dir = tmp_path / f"dp{nproc}"
    _run(["train", "--config", CONFIG, *MINI, f"trainer.run_dir={run_dir}"], nproc=nproc)
    rows = _rows(run_dir)
    assert sorted(rows) == [1, 2] and rows[1]["num_sequences"] == 8 * 4
    evals = _evals(run_dir)
    assert len(evals) == 2 and all(0 <= e["eval_tool_call_rate"] <= 1 for e in evals)


@pytest.mark.slow
def test_multiturn_demo_command(tmp_path):
    run_dir = tmp_path / "demo"
    res = _run(["demo", "--multi-turn", "--run-dir", str(run_dir), "--tool-share", "0.5", "sft.max_steps=4",
                "sft.eval_every=4", *MINI])
    assert "held-out tool-call rate: before RL" in res.stdout and "held-out accuracy (avg@2)" in res.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"tool_call_rate_before", "tool_call_rate_after", "eval_accuracy_before"} <= set(summary)
    transcripts = [json.loads(line) for line in (run_dir / "sft_data" / "train.jsonl").read_text().splitlines()]
    tool = [t for t in transcripts if "?" in t["answer"]]
    assert 0.35 < len(tool) / len(transcripts) < 0.65
    p, a = tool[0]["prompt"], tool[0]["answer"]
    x, y = p[:-1].split("*")
    assert a == f"{p[:-1]}?{int(x) * int(y)}={int(x) * int(y)}"


def test_trajectory_must_fit_the_training_sequence():
    with pytest.raises(ValueError, match="multiturn.max_total_tokens=40 exceeds rollout.max_new_tokens=16"):
        load_run_config(ROOT / CONFIG, ["multiturn.max_total_tokens=40"])
    with pytest.raises(ValueError, match="multiturn.env_timeout_s=0"):
        load_run_config(ROOT / CONFIG, ["multiturn.env_timeout_s=0"])
    assert load_run_config(ROOT / CONFIG, ["multiturn.env=null"]).multiturn.enabled is False
