"""Multi-turn GSPO-token with per-turn advantages in the real trainer, on an environment that rewards turns and
fails for a third of the prompts: environment failures count as failed reward calls (`scoring.max_error_frac`)
and the multi-turn counts reach metrics.jsonl; DP=2 (real gloo ranks) trains on the 1-process run's trajectories
to the same metrics and weights."""

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.multiturn_ranks import FLAKY, failing_step, multiturn_steps

VOLATILE = ("time_", "tokens_per_s")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mt") / "dp1"
    return run_distributed(multiturn_steps, str(run_dir), FLAKY, world_size=1, timeout=600)[0] | {"dir": run_dir}


def _counts(trajectories):
    """The step's multi-turn counts from its trajectories, by their loss masks (not the driver's bookkeeping)."""
    rollouts = [r for group in trajectories for r in group]
    turns = []
    for r in rollouts:
        if "env_error" in r.extra:
            turns.append(r.extra["turns"])  # a failed sample's mask is all 0
            continue
        mask = r.loss_mask
        turns.append(sum(1 for p, m in enumerate(mask) if m and (p == 0 or not mask[p - 1])))
    return {"n": len(rollouts), "errors": sum("env_error" in r.extra for r in rollouts), "turns_max": max(turns),
            "turns_mean": sum(turns) / len(turns), "tool": sum(t > 1 for t in turns)}


def test_environment_failures_are_reward_errors_and_multiturn_counts_are_logged(single):
    rows = single["metrics"]
    on_disk = [json.loads(line) for line in (Path(single["dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on_disk] == [1, 2]
    for row, disk, trajectories in zip(rows, on_disk, single["trajectories"]):
        c = _counts(trajectories)
        assert c["errors"] > 0, "no environment failed: the count is untested"
        for key in ("multiturn_env_errors", "reward_errors"):
            assert row[key] == disk[key] == c["errors"], key
        assert row["reward_error_frac"] == pytest.approx(c["errors"] / c["n"])
        assert row["multiturn_turns_max"] == c["turns_max"]
        assert row["multiturn_turns_mean"] == pytest.approx(c["turns_mean"])
        assert row["multiturn_tool_calls"] >= c["tool"]
        for key in ("multiturn_turn_limit", "multiturn_token_limit", "multiturn_tool_call_rate"):
            assert key in disk
    failed = [r for t in single["trajectories"] for g in t for r in g if "env_error" in r.extra]
    assert all("raised ConnectionError: calculator service unavailable" in r.extra["env_error"] for r in failed)


def test_failures_reaching_max_error_frac_end_the_run(tmp_path):
    message = run_distributed(failing_step, str(tmp_path / "run"),
                              [*FLAKY, "scoring.max_error_frac=0.1", "trainer.steps=1"], world_size=1, timeout=600)[0]
    assert message.startswith("step 1: ") and "reward calls failed (scoring.max_error_frac=0.1)" in message
    assert "the first: environment step: raised ConnectionError: calculator service unavailable" in message


def test_data_parallel_trains_like_one_process(single, tmp_path):
    ranks = run_distributed(multiturn_steps, str(tmp_path / "dp2"), FLAKY, replay=single["trajectories"],
                            world_size=2, timeout=600)
    for rank in ranks:
        assert len(rank["metrics"]) == 2
        for step, (one, two) in enumerate(zip(single["metrics"], rank["metrics"]), 1):
            differ = [(key, value, two[key]) for key, value in one.items() if not key.startswith(VOLATILE)
                      and two[key] != pytest.approx(value, rel=1e-5, abs=1e-7)]
            assert not differ, (step, differ)
        for name, weight in single["weights"].items():
            torch.testing.assert_close(rank["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
    assert single["metrics"][0]["grad_norm"] > 0
