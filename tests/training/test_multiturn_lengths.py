"""DAPO's overlong penalty and the length metrics of multi-turn trajectories count the model's tokens only: the
environment's / tool's tokens between turns (Rollout.loss_mask 0) are not the model's answer."""

import pytest
import torch

from megatron_gspo.algorithms import overlong_penalty
from megatron_gspo.batching.batch import pack_rollouts
from megatron_gspo.rollout.types import Rollout
from megatron_gspo.training.config import load_run_config
from megatron_gspo.training.corrections import BatchCorrections
from tests.training.test_end_to_end import ROOT

CONFIG = ROOT / "examples" / "tiny_moe_calculator.yaml"  # multiturn.max_total_tokens=16


def _trajectory(model: list[int], env: tuple[int, ...] = (), finish="stop") -> Rollout:
    """Model turns of the given lengths with environment observations of the given lengths between them."""
    ids, mask = [], []
    for k, n in enumerate(model):
        ids += [3] * n
        mask += [1] * n
        if k < len(env):
            ids += [4] * env[k]
            mask += [0] * env[k]
    return Rollout([1, 2], ids, [0.0] * len(ids), finish, loss_mask=mask)


def test_overlong_penalty_counts_model_tokens_not_environment_tokens():
    cfg = load_run_config(CONFIG, ["loss.overlong_buffer=4"])
    corrections = BatchCorrections(cfg)
    # L_max = multiturn.max_total_tokens = 16, L_cache = 4: a model length L > 12 is penalised (12 - L) / 4.
    rollouts = [
        _trajectory([3, 3], [8]),  # 14 tokens, 6 of them the model's: no penalty (14 would give -0.5)
        _trajectory([7, 6], [2]),  # 15 tokens, 13 the model's: -0.25 (15 would give -0.75)
        _trajectory([10]),  # single-turn-like, all the model's: 0
        Rollout([1, 2], [3] * 14, [0.0] * 14, "length"),  # no loss mask: every token the model's, -0.5
    ]
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    penalised = corrections.penalize(rewards, rollouts)
    assert penalised.tolist() == pytest.approx([1.0, 0.75, 0.0, -0.5])
    # What counting every response token would have given: the environment's tokens change the answer.
    by_total = overlong_penalty(torch.tensor([len(r.response_ids) for r in rollouts]), 16, 4)
    assert by_total.tolist()[:2] == pytest.approx([-0.5, -0.75])

    # The step's overlong statistics and length metrics read the packed batch's model lengths.
    batch = pack_rollouts(rollouts, 18, 0, penalised, torch.zeros(4))
    assert batch.model_lens_N.tolist() == [6, 13, 10, 14]
    assert batch.response_lens_N.tolist() == [14, 15, 10, 14]  # the layout's lengths are unchanged
    metrics = corrections.apply(batch, step=0, recomputed=False)
    assert metrics["overlong_penalty_mean"] == pytest.approx((0 - 0.25 + 0 - 0.5) / 4)
    assert metrics["overlong_penalized_frac"] == pytest.approx(2 / 4)


def test_overlong_buffer_is_checked_against_the_trajectory_budget():
    with pytest.raises(ValueError, match="loss.overlong_buffer=17 must be <= multiturn.max_total_tokens=16"):
        load_run_config(CONFIG, ["loss.overlong_buffer=17"])
    assert BatchCorrections(load_run_config(CONFIG, ["multiturn.env=null"])).max_length == 16  # max_new_tokens


def test_per_turn_advantages_need_a_per_token_loss():
    with pytest.raises(ValueError, match="multiturn.advantage=turn_return gives each token its turn's advantage, "
                                         "but loss.algorithm=gspo"):
        load_run_config(CONFIG, ["multiturn.advantage=turn_return"])
    with pytest.raises(ValueError, match="multiturn.advantage='turns' must be one of trajectory, turn_return"):
        load_run_config(CONFIG, ["multiturn.advantage=turns"])
    assert load_run_config(CONFIG, ["multiturn.advantage=turn_return", "loss.algorithm=gspo_token"])
