"""PolicyLossConfig / RolloutCorrectionConfig validation and the PolicyLoss objects they select."""

import pytest
import torch

from megatron_gspo.algorithms import (
    ALGORITHMS,
    POLICY_LOSSES,
    GRPOLoss,
    GSPOLoss,
    GSPOTokenLoss,
    PolicyLossConfig,
    RolloutCorrectionConfig,
    grpo_loss,
    gspo_loss,
    gspo_loss_from_sums,
    gspo_token_loss,
    make_policy_loss,
)
from tests.algorithms import reference as ref


def test_config_surface_is_pinned():
    cfg = PolicyLossConfig()
    assert (cfg.algorithm, cfg.clip_low, cfg.clip_high, cfg.grpo_aggregation) == (
        "gspo", None, None, "seq-mean-token-mean",
    )
    rc = RolloutCorrectionConfig()
    assert (rc.level, rc.mode, rc.threshold) == ("off", "truncate", 2.0)
    assert set(POLICY_LOSSES) == set(ALGORITHMS) == {"gspo", "gspo_token", "grpo"}


@pytest.mark.parametrize(
    "algorithm, expected",
    [("gspo", (3e-4, 4e-4)), ("gspo_token", (3e-4, 4e-4)), ("grpo", (0.2, 0.27))],
)
def test_clip_defaults_are_the_papers(algorithm, expected):
    assert PolicyLossConfig(algorithm=algorithm).clip_range == expected
    assert PolicyLossConfig(algorithm=algorithm, clip_high=0.5).clip_range == (expected[0], 0.5)
    loss = make_policy_loss(PolicyLossConfig(algorithm=algorithm))
    assert (loss.clip_low, loss.clip_high) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"algorithm": "ppo"}, "loss.algorithm='ppo' is unknown; choose gspo, gspo_token or grpo"),
        ({"clip_low": 1.5}, "loss.clip_low=1.5"),
        ({"clip_low": "0.2"}, "loss.clip_low='0.2'"),
        ({"clip_high": -1.0}, "loss.clip_high=-1.0"),
        ({"grpo_aggregation": "sum"}, "loss.grpo_aggregation='sum'"),
    ],
)
def test_policy_loss_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError) as info:
        PolicyLossConfig(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"level": "batch"}, "rollout.correction.level"),
        ({"mode": "x"}, "rollout.correction.mode"),
        ({"threshold": 0.9}, "rollout.correction.threshold"),
        ({"threshold": True}, "rollout.correction.threshold"),
    ],
)
def test_rollout_correction_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        RolloutCorrectionConfig(**kwargs)


def test_policy_loss_objects_call_the_functions():
    lp, old, mask = ref.make_batch([3, 2, 4], 4, seq_offsets=[1e-3, -1e-3, 0.0], seed=71)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    adv_BT = adv[:, None].expand(3, 4)

    gspo = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.1, clip_high=0.2))
    assert isinstance(gspo, GSPOLoss) and gspo.sequence_level
    expected = gspo_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.2, num_sequences=6).loss
    torch.testing.assert_close(gspo(lp, old, adv, mask, num_sequences=6, num_tokens=99).loss, expected)
    lp_sum, old_sum = torch.where(mask, lp, 0.0).sum(-1), torch.where(mask, old, 0.0).sum(-1)
    sums = gspo.from_sums(lp_sum, old_sum, mask.sum(-1), adv, num_sequences=6)
    torch.testing.assert_close(sums.loss, expected)
    direct = gspo_loss_from_sums(
        lp_sum, old_sum, mask.sum(-1), adv, clip_low=0.1, clip_high=0.2, num_sequences=6
    )
    torch.testing.assert_close(sums.loss, direct.loss)

    token = make_policy_loss(PolicyLossConfig(algorithm="gspo_token"))
    assert isinstance(token, GSPOTokenLoss) and not token.sequence_level
    torch.testing.assert_close(token(lp, old, adv_BT, mask).loss, gspo_token_loss(lp, old, adv_BT, mask).loss)

    grpo = make_policy_loss(PolicyLossConfig(algorithm="grpo", grpo_aggregation="token-mean"))
    assert isinstance(grpo, GRPOLoss) and not grpo.sequence_level and grpo.aggregation == "token-mean"
    torch.testing.assert_close(
        grpo(lp, old, adv, mask, num_sequences=5, num_tokens=11).loss,
        grpo_loss(lp, old, adv, mask, aggregation="token-mean", num_tokens=11).loss,
    )
    with pytest.raises(TypeError, match="loss.algorithm='grpo'"):
        grpo.from_sums(lp.sum(-1), old.sum(-1), mask.sum(-1), adv)
