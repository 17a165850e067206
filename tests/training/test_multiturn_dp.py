"""Multi-turn GSPO-token with per-turn advantages in the real trainer, on an environment that rewards turns and
fails for a third of the prompts: environment failures count as failed reward calls (`scoring.max_error_frac`)
and the multi-turn counts reach metrics.jsonl; DP=2 (real gloo ranks) trains on the 1-process run's trajectories
to the same metrics and weights."""

import json
from pathlib import Path

import pytest
import torch

from megatron_gspo.data import CharTokenizer
from tests.distributed import run_distributed
from tests.training.multiturn_ranks import FLAKY, failing_step, multiturn_steps

VOLATILE = ("time_", "tokens_per_s")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mt") / "dp1"
    return run_distributed(multiturn_steps, str(run_dir), FLAKY, world_size=1, timeout=600)[0] | {"dir": run_dir}


def _counts(trajectories):
    """The step's multi-turn counts from its trajectories' tokens and prompts alone (not the driver's bookkeeping):
    the environment fails on prompts starting with 1, 2 or 3, at its first step (ShapedFlakyCalculator), so such a
    sample has one model turn and no tool call; otherwise model turns are the loss mask's runs of 1, a tool call
    is a model turn ending in '?' (the calculator answers it and the episode goes on), and a trajectory whose
    last model turn is a tool call was cut: at max_turns=2 by the turn limit, earlier by the token budget (the
    observation did not fit), as is an answer cut at max_total_tokens=16."""
    tok = CharTokenizer("0123456789+-*=?")
    (call,) = tok.encode("?")
    rollouts = [r for group in trajectories for r in group]
    c = {"n": len(rollouts), "errors": 0, "turns": [], "tool": 0, "tool_rate": 0, "turn_limit": 0, "token_limit": 0}
    for r in rollouts:
        if tok.decode(r.prompt_ids)[:1] in ("1", "2", "3"):
            c["errors"] += 1
            c["turns"].append(1)
            c["token_limit"] += r.finish_reason == "length" and len(r.response_ids) >= 16
            continue
        mask, turns = r.loss_mask, []
        for p, m in enumerate(mask):
            if m and (p == 0 or not mask[p - 1]):
                turns.append([])
            if m:
                turns[-1].append(r.response_ids[p])
        calls = sum(t[-1] == call for t in turns)
        c["turns"].append(len(turns))
        c["tool"] += calls
        c["tool_rate"] += calls > 0
        if turns[-1][-1] == call and len(turns) == 2:
            c["turn_limit"] += 1
        elif turns[-1][-1] == call or (r.finish_reason == "length" and len(r.response_ids) >= 16):
            c["token_limit"] += 1
    return c


def test_environment_failures_are_reward_errors_and_multiturn_counts_are_logged(single):
    rows = single["metrics"]
    on_disk = [json.loads(line) for line in (Path(single["dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on_disk] == [1, 2]
    for row, disk, trajectories in zip(rows, on_disk, single["trajectories"]):
        c = _counts(trajectories)
        assert c["errors"] > 0, "no environment failed: the count is untested"
        assert c["tool"] > 0, "no tool call: the counts are untested"
        for key in ("multiturn_env_errors", "reward_errors"):
            assert row[key] == disk[key] == c["errors"], key
        assert row["reward_error_frac"] == pytest.approx(c["errors"] / c["n"])
        assert disk["multiturn_turns_max"] == max(c["turns"])
        assert disk["multiturn_turns_mean"] == pytest.approx(sum(c["turns"]) / c["n"])
        assert disk["multiturn_tool_calls"] == c["tool"]
        assert disk["multiturn_tool_call_rate"] == pytest.approx(c["tool_rate"] / c["n"])
        assert disk["multiturn_turn_limit"] == c["turn_limit"]
        assert disk["multiturn_token_limit"] == c["token_limit"]
        assert {k: row[k] for k in disk if k.startswith("multiturn_")} == {k: v for k, v in disk.items()
                                                                           if k.startswith("multiturn_")}
    failed = [r for t in single["trajectories"] for g in t for r in g if "env_error" in r.extra]
    assert len(failed) == sum(_counts(t)["errors"] for t in single["trajectories"])
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
