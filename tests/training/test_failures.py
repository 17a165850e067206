"""Runs that cannot learn end with one line instead of training to the end on nothing: failing rewards (raising,
sys.exit, hanging past the timeout) and a dead policy (zero gradient with learning signal)."""

import json
import subprocess
import sys

import pytest

from megatron_gspo.lifecycle.health import HealthConfig, HealthMonitor
from tests.training.test_end_to_end import MINI, ROOT, _env


def _train_fails(run_dir, extra, tracebacks=False):
    """The last stderr line of a run that must exit 1. (`tracebacks`: the first failing reward call is logged with
    the reward's own traceback, on purpose: it is the user's code.)"""
    cmd = [sys.executable, "-m", "megatron_gspo.cli.main", "train", "--config", "examples/tiny_moe_gspo.yaml", *MINI,
           f"trainer.run_dir={run_dir}", *extra]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    assert tracebacks or "Traceback" not in res.stderr, res.stderr[-3000:]
    return res.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "reward, extra, calls, message",
    [
        ("always_fails", [], 32, "RuntimeError: the grader is down"),
        ("exits", [], 32, "called sys.exit(3)"),
        # Every call times out (and costs a worker restart): a small batch.
        ("hangs", ["scoring.timeout_s=0.2", "trainer.prompts_per_step=2", "eval.max_prompts=2"], 8,
         "reward call timed out after 0.2 s"),
    ],
)
def test_a_reward_that_always_fails_fails_the_step(tmp_path, reward, extra, calls, message):
    line = _train_fails(tmp_path / "run", [f"data.reward=tests.training.rewards:{reward}", *extra], tracebacks=True)
    assert "megatron_gspo/" not in line
    assert line.startswith(
        f"megatron-gspo: error: step 1: {calls} of {calls} reward calls failed (scoring.max_error_frac=1)"
    )
    assert f"reward 'tests.training.rewards:{reward}' failed on" in line and line.endswith(message)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_dead_policy_is_reported_and_stops_the_run(tmp_path):
    """lr=1e3 saturates the model: from step 2 the gradient is exactly zero while rewards still vary."""
    run = tmp_path / "run"
    line = _train_fails(run, ["optim.lr=1000", "data.reward=tests.training.rewards:contains_one", "trainer.steps=6",
                              "health.zero_grad_window=2", "health.stop=true"])
    assert "the policy looks dead: zero gradient for 2 steps although advantages are non-zero" in line
    assert "optim.lr=1000" in line and line.endswith("stopped (health.stop=true)")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["health_zero_grad"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["grad_norm"] == 0.0 and r["health_no_signal"] == 0.0 for r in rows[1:])
    assert all(r["reward_error_frac"] == 0.0 for r in rows)


def test_health_windows_warn_once_per_streak(caplog):
    monitor = HealthMonitor(HealthConfig(zero_grad_window=2, no_signal_window=3), lr=0.5)
    seen = []
    for step, (norms, signal) in enumerate(
        [([0.0, 0.0], True), ([0.0, float("nan")], True), ([0.0], True), ([1.0], True),  # dead twice, then alive
         ([0.0], False), ([0.0], False), ([0.0], False), ([0.0], False)],  # no signal: not a dead gradient
        start=1,
    ):
        seen.append(monitor.observe(step, norms, signal, 0.0))
    assert [m["health_zero_grad"] for m in seen] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert [m["health_no_signal"] for m in seen] == [0, 0, 0, 0, 1, 1, 1, 1]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("policy looks dead" in m for m in messages) == 1 and "step 2:" in messages[0]
    assert sum("no learning signal for 3 steps" in m for m in messages) == 1
    assert monitor.failure is None
    skipped = HealthMonitor(HealthConfig(zero_grad_window=1))
    assert skipped.observe(1, [float("nan")], True, 0.0)["health_zero_grad"] == 0  # a skipped step is not dead
    stopping = HealthMonitor(HealthConfig(no_signal_window=1, stop=True))
    stopping.observe(4, [1.0], False, 0.0)
    assert stopping.failure.startswith("step 4: no learning signal for 1 steps") and "health.stop=true" in stopping.failure


def test_health_streaks_continue_across_a_resume():
    # Two zero-gradient steps before the checkpoint and one after it fill a window of 3 (a resume used to restart it).
    before = HealthMonitor(HealthConfig(zero_grad_window=3, stop=True))
    for step in (1, 2):
        before.observe(step, [0.0], True, 0.5)
    state = json.loads(json.dumps(before.state_dict()))  # as trainer_state.json holds it
    after = HealthMonitor(HealthConfig(zero_grad_window=3, stop=True))
    after.load_state_dict(state)
    after.observe(3, [0.0], True, 0.5)
    assert after.failure is not None and after.failure.startswith("step 3: the policy looks dead: zero gradient for 3")
    HealthMonitor(HealthConfig()).load_state_dict({})  # a checkpoint without it: fresh streaks
