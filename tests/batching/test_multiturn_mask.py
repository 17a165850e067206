"""Multi-turn trajectories in the training layout: only the model's tokens are labels of the loss
(`Rollout.loss_mask`), so the environment's tokens get zero gradient and never count in a token mean or in GSPO's length |y_i| (Eq. 7).

Expected gradients are the paper's, by hand: at pi_theta = pi_old (s_i = 1, unclipped) GSPO's Eq. 10 gives each model
token -(1/N) A_i / |y_i| in d(loss)/d(log pi), GRPO's Eq. 11 the same (w = 1, token mean over |y_i|).
"""

import pytest
import torch

from megatron_gspo.algorithms.config import PolicyLossConfig
from megatron_gspo.algorithms.policy import make_policy_loss
from megatron_gspo.batching.batch import pack_rollouts
from megatron_gspo.rollout.types import Rollout

# prompt 3 tokens | model 2 | tool 3 | model 2 (the last one the stop token)
MASK = [1, 1, 0, 0, 0, 1, 1]


def _trajectory():
    return Rollout(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12, 13, 1],
                   logprobs=[-0.5, -0.5, 0.0, 0.0, 0.0, -0.5, -0.5], finish_reason="stop", loss_mask=MASK)


def _batch():
    single = Rollout(prompt_ids=[5, 6], response_ids=[8, 1], logprobs=[-0.5, -0.5], finish_reason="stop")
    return pack_rollouts([_trajectory(), single], seq_len=11, pad_id=0, rewards=torch.tensor([1.0, 0.0]),
                         advantages=torch.tensor([1.0, -1.0]))


def test_pack_rollouts_labels_only_the_models_tokens():
    batch = _batch()
    labels = batch.tokens_NL[:, 1:]
    assert labels[0][batch.loss_mask_NS[0]].tolist() == [8, 9, 13, 1]
    assert batch.loss_mask_NS[0].tolist() == [False, False] + [bool(m) for m in MASK] + [False, False]
    assert labels[1][batch.loss_mask_NS[1]].tolist() == [8, 1]  # a single-turn rollout is unchanged
    assert batch.engine_logprobs_NS[0][batch.loss_mask_NS[0]].tolist() == [-0.5] * 4
    assert batch.response_lens_N.tolist() == [7, 2]  # every response token is an input of the model


def test_loss_mask_must_match_the_response():
    with pytest.raises(ValueError, match="7 response tokens but a loss mask of 2"):
        Rollout(prompt_ids=[1], response_ids=[2] * 7, logprobs=[0.0] * 7, finish_reason="stop", loss_mask=[1, 0])


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_environment_tokens_get_zero_gradient_and_do_not_count(algorithm):
    batch = _batch()
    loss_fn = make_policy_loss(PolicyLossConfig(algorithm=algorithm))
    old = batch.engine_logprobs_NS
    logprobs = old.clone().requires_grad_(True)
    out = loss_fn(logprobs, old, batch.advantages_N, batch.loss_mask_NS)
    out.loss.backward()
    grad = logprobs.grad
    mask = batch.loss_mask_NS
    env = torch.zeros_like(mask)
    env[0, 2 + 2 : 2 + 5] = True  # the tool's three tokens (label positions 4..6)
    assert grad[env].abs().max() == 0
    # Model tokens: -(1/N) A / |y| with N = 2 sequences and |y| = 4 model tokens (not 7) for the trajectory.
    torch.testing.assert_close(grad[0][mask[0]], torch.full((4,), -1.0 / 2 / 4))
    torch.testing.assert_close(grad[1][mask[1]], torch.full((2,), 1.0 / 2 / 2))
    # What the policy gives the tool's tokens changes nothing.
    moved = logprobs.detach().clone()
    moved[env] -= 3.0
    again = loss_fn(moved, old, batch.advantages_N, batch.loss_mask_NS)
    torch.testing.assert_close(again.loss, out.loss.detach())


def test_gspo_sequence_ratio_is_normalised_over_the_models_tokens():
    batch = _batch()
    loss_fn = make_policy_loss(PolicyLossConfig(algorithm="gspo", clip_low=0.9, clip_high=10.0))
    old = batch.engine_logprobs_NS
    new = old.clone()
    new[0][batch.loss_mask_NS[0]] += torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = loss_fn(new, old, batch.advantages_N, batch.loss_mask_NS)
    # s = exp(mean over the 4 model tokens) = exp(0.25); loss = -(1/2) (s * 1 + 1 * (-1)).
    expected = -0.5 * (torch.exp(torch.tensor(1.0 / 4)) - 1.0)
    torch.testing.assert_close(out.loss, expected)
