"""Reward registry resolution and the fault-tolerant RewardScorer."""

import logging
import math

import pytest
import torch

from megatron_gspo.rewards import RewardScorer, get_reward, register_reward, registered_rewards
from megatron_gspo.rewards.exact_match import exact_match

USER_MODULE = '''
CALLS = []

def score(response, answer, meta):
    return 2.0 if response == answer else -1.0

class Holder:
    @staticmethod
    def score(response, answer, meta):
        return 0.25

not_a_function = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_mod"


def test_builtins_are_registered():
    assert {"exact_match", "boxed_exact_match", "math_verify"} <= set(registered_rewards())
    assert get_reward("exact_match") is exact_match


def test_module_function_path(user_module):
    fn = get_reward(f"{user_module}:score")
    assert fn("7", "7", {}) == 2.0 and fn("7", "8", {}) == -1.0
    assert get_reward(f"{user_module}:Holder.score")("a", "b", {}) == 0.25


def test_bad_names_and_paths_explain_themselves(user_module):
    with pytest.raises(ValueError, match="unknown reward 'exact'; registered: boxed_exact_match, exact_ma"):
        get_reward("exact")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz' \\(ModuleNotFoundError"):
        get_reward("no_such_module_xyz:score")
    with pytest.raises(ValueError, match=f"module '{user_module}' has no attribute 'scor'"):
        get_reward(f"{user_module}:scor")
    with pytest.raises(ValueError, match="'not_a_function' is a int, not a function"):
        get_reward(f"{user_module}:not_a_function")
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        get_reward(":score")


def test_register_reward_refuses_to_shadow():
    @register_reward("test_only_constant")
    def constant(response, answer, meta):
        return 1.0

    assert get_reward("test_only_constant") is constant
    with pytest.raises(ValueError, match="'exact_match' is already registered"):
        register_reward("exact_match")(constant)
    with pytest.raises(ValueError, match="contain no ':'"):
        register_reward("a:b")


def test_scorer_returns_float32_rewards(user_module):
    scorer = RewardScorer(f"{user_module}:score")
    rewards = scorer.score(["1", "2", "3"], ["1", "0", "3"], [{}, {}, {}])
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [2.0, -1.0, 2.0]
    assert scorer.last_metrics["reward_errors"] == 0 and scorer.num_errors == 0
    assert scorer.last_metrics["reward_mean"] == pytest.approx(1.0)


def test_exceptions_and_non_finite_values_score_zero_are_counted_and_logged_once(caplog):
    def flaky(response, answer, meta):
        if response == "boom":
            raise RuntimeError("reward bug")
        if response == "nan":
            return math.nan
        if response == "none":
            return None
        return 1.0

    scorer = RewardScorer(flaky)
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.rewards.registry"):
        first = scorer.score(["ok", "boom", "nan", "none"], ["a"] * 4, None)
        second = scorer.score(["boom", "ok"], ["a", "a"], [{}, {}])
    assert first.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert second.tolist() == [0.0, 1.0]
    assert scorer.num_errors == 4 and scorer.num_scored == 6
    assert scorer.last_metrics["reward_errors"] == 1
    failures = [r for r in caplog.records if "failed on batch item" in r.getMessage()]
    assert len(failures) == 1
    assert "RuntimeError: reward bug" in failures[0].getMessage() and "'flaky'" in failures[0].getMessage()


def test_scorer_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="2 responses, 1 answers and 2 metas"):
        RewardScorer("exact_match").score(["a", "b"], ["a"], [{}, {}])
