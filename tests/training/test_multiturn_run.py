"""Multi-turn GSPO end to end: `megatron-gspo train` on the calculator config (DP=2 with torchrun; 1 process, killed
mid-episode with SIGKILL and resumed), the `demo --multi-turn` command on tiny numbers, and the config rule that a
trajectory fits a training sequence."""

import json
import subprocess
import sys

import pytest

from megatron_gspo.training.config import load_run_config
from tests.training.test_end_to_end import ROOT, _env, _kill_and_resume, _rows

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
@pytest.mark.parametrize("nproc", [2])  # 1 process: the resume test's uninterrupted run
def test_multiturn_train_run(tmp_path, nproc):
    run_dir = tmp_path / f"dp{nproc}"
    _run(["train", "--config", CONFIG, *MINI, f"trainer.run_dir={run_dir}"], nproc=nproc)
    rows = _rows(run_dir)
    assert sorted(rows) == [1, 2] and rows[1]["num_sequences"] == 8 * 4
    evals = _evals(run_dir)
    assert len(evals) == 2 and all(0 <= e["eval_tool_call_rate"] <= 1 for e in evals)


@pytest.mark.slow
def test_killed_multiturn_run_resumes_exactly(tmp_path, monkeypatch):
    """kill -9 while step 2 has its episodes in flight (environments being reset, steps pending): the resumed run
    discards them with the process and regenerates step 2 from the checkpointed sampler with the step's seeds,
    the environments reseeded alike (their per-turn bonus is drawn from the reset's seed), with per-turn routes
    replayed (R3) and per-turn advantages (GSPO-token), so its metrics equal the uninterrupted run's
    (_kill_and_resume)."""
    log = tmp_path / "env.log"
    monkeypatch.setenv("MT_ENV_LOG", str(log))
    episodes, held_out = 8 * 4, 4  # trajectories of a step, and of the held-out evaluation (4 prompts x 1)

    def calls_of_run(k: int) -> list[str]:
        """The environment calls of the k-th run (0: uninterrupted, 1: killed, 2: resumed), by process id."""
        calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
        pids = list(dict.fromkeys(pid for pid, _ in calls))
        return [what for pid, what in calls if len(pids) > k and pid == pids[k]]

    def mid_episode() -> bool:
        """The killed run has reset the environments of step 2 (after the evaluation's and step 1's)."""
        return calls_of_run(1).count("reset") > held_out + episodes

    steps = [*MINI[1:-2], "eval.max_prompts=4", "eval.n=1", "trainer.steps=2", "trainer.ckpt_every=1", "trainer.save_final=false", "moe.routing_replay=r3",
             "loss.algorithm=gspo_token", "multiturn.advantage=turn_return",
             "multiturn.env=tests.rollout.multiturn.envs:SlowSeededCalculator"]
    _kill_and_resume(tmp_path, steps, 2, 1, ready=mid_episode, config=CONFIG, mini=())
    killed = calls_of_run(1)
    resets = [k for k, what in enumerate(killed) if what == "reset"]
    # Killed mid-episode: all of step 2's environments reset, fewer steps taken since than its trajectories need.
    assert held_out + episodes < len(resets) <= held_out + 2 * episodes, len(resets)
    assert killed[resets[held_out + episodes] :].count("step") < episodes
    assert calls_of_run(2).count("reset") >= episodes + held_out  # the resumed run: step 2 again, the evaluation
    rows = _rows(tmp_path / "full")
    assert sorted(rows) == [1, 2] and rows[1]["num_sequences"] == 8 * 4
    assert all(r["multiturn_turns_max"] >= 1 and r["reward_errors"] == 0 for r in rows.values())
    evals = _evals(tmp_path / "full")
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
