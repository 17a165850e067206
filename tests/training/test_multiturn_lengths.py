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


def test_overlong_penalty_measures_model_tokens_against_what_the_budget_leaves_them():
    cfg = load_run_config(CONFIG, ["loss.overlong_buffer=4"])
    corrections = BatchCorrections(cfg)
    # multiturn.max_total_tokens = 16, L_cache = 4; L = a trajectory's model tokens, L_max = 16 - its environment
    # tokens: penalised (L_max - 4 - L) / 4 past L_max - 4, written out per row.
    failed = _trajectory([15])
    failed.loss_mask = [0] * 15  # a failed environment's sample: nothing of the model's to penalise
    rollouts = [
        _trajectory([3, 3], [8]),  # L = 6, L_max = 8: (4 - 6) / 4 = -0.5 (its model tokens alone: 6 <= 12, none)
        _trajectory([7, 6], [2]),  # L = 13, L_max = 14: (10 - 13) / 4 = -0.75
        _trajectory([4], [11]),  # L = 4, L_max = 5 (its next turn would be cut): (1 - 4) / 4 = -0.75
        _trajectory([10]),  # single-turn-like, L = 10, L_max = 16: 0
        Rollout([1, 2], [3] * 14, [0.0] * 14, "length"),  # no loss mask: L = 14, L_max = 16: -0.5
        failed,
    ]
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    penalised = corrections.penalize(rewards, rollouts)
    assert penalised.tolist() == pytest.approx([0.5, 0.25, 0.25, 0.0, -0.5, 0.0])

    # The step's overlong statistics read the packed batch's lengths the same way; its length metrics are the
    # model's tokens.
    batch = pack_rollouts(rollouts, 18, 0, penalised, torch.zeros(6))
    assert batch.model_lens_N.tolist() == [6, 13, 4, 10, 14, 0]
    assert batch.response_lens_N.tolist() == [14, 15, 15, 10, 14, 15]  # the layout's lengths are unchanged
    metrics = corrections.apply(batch, step=0, recomputed=False)
    assert metrics["overlong_penalty_mean"] == pytest.approx((-0.5 - 0.75 - 0.75 + 0 - 0.5 + 0) / 6)
    assert metrics["overlong_penalized_frac"] == pytest.approx(4 / 6)


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
    with pytest.raises(ValueError, match="multiturn.advantage=turn_return needs multi-turn rollouts; set "
                                         "multiturn.env or multiturn.advantage=trajectory"):
        load_run_config(CONFIG, ["multiturn.env=null", "multiturn.advantage=turn_return", "loss.algorithm=gspo_token"])
