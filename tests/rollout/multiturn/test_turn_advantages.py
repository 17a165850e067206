"""Per-turn advantages of multi-turn trajectories (`multiturn.advantage=turn_return`) for GSPO-token: the return
from each turn on, normalised with Eq.6's group statistics, given to every model token of the turn; checked
against the formula written out by hand, through the training layout (pack_rollouts) into GSPO-token's loss and
its gradient (Eq.17), and GSPO-token with equal per-turn advantages against GSPO (the paper's property)."""

import math

import pytest
import torch

from megatron_gspo.algorithms import gspo_loss, gspo_token_loss, group_advantages, turn_return_advantages
from megatron_gspo.batching.batch import pack_rollouts
from megatron_gspo.rollout.multiturn import turn_token_advantages
from megatron_gspo.rollout.types import Rollout
from tests.algorithms import reference as ref

SEQ = 24
PAD = 0


def _trajectory(group: int, segments: list[tuple[str, int]], turn_rewards: list[float]) -> Rollout:
    """A trajectory of ('model' | 'env', n tokens) segments; token ids are arbitrary but distinct per segment."""
    ids, mask, starts = [], [], []
    for k, (who, n) in enumerate(segments):
        if who == "model":
            starts.append(len(ids))
        ids += [1 + (k * 3 + j) % 13 for j in range(n)]
        mask += [int(who == "model")] * n
    extra = {"turns": len(starts), "turn_rewards": list(turn_rewards), "turn_starts": starts,
             "env_reward": sum(turn_rewards)}
    return Rollout(prompt_ids=[5, 6, 7], response_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop",
                   prompt_index=group, extra=extra, loss_mask=mask)


# Group 0: rewards on several turns (a shaped tool call, then the answer); group 1: only the last turn rewarded.
GROUP0 = [
    _trajectory(0, [("model", 3), ("env", 2), ("model", 2)], [0.25, 1.0]),
    _trajectory(0, [("model", 4)], [0.0]),
    _trajectory(0, [("model", 2), ("env", 3), ("model", 1), ("env", 2), ("model", 2)], [0.25, 0.25, 0.0]),
]
GROUP1 = [
    _trajectory(1, [("model", 2), ("env", 2), ("model", 3)], [0.0, 1.0]),
    _trajectory(1, [("model", 5)], [0.0]),
    _trajectory(1, [("model", 1), ("env", 4), ("model", 2), ("env", 1), ("model", 1)], [0.0, 0.0, 1.0]),
]
# The rewards the trainer trains on: the environments' sums, one with DAPO's overlong penalty (-0.5) added.
REWARDS = torch.tensor([1.25, 0.0, 0.5 - 0.5, 1.0, 0.0, 1.0])


def _by_hand(rollouts, rewards, group_size, eps=1e-6):
    """A_i,u = (R_i,u - mean_j R_j,u) / (std_j R_j,u + eps), R_i,u = r_i - (turn rewards before u), a trajectory
    past its last turn counted at its last turn; in Python."""
    out = []
    for g in range(0, len(rollouts), group_size):
        group = range(g, g + group_size)
        turns = {i: list(rollouts[i].extra["turn_rewards"]) for i in group}
        width = max(len(t) for t in turns.values())
        columns = []
        for u in range(width):
            returns = [float(rewards[i]) - sum(turns[i][: min(u, len(turns[i]) - 1)]) for i in group]
            mean = sum(returns) / group_size
            std = math.sqrt(sum((x - mean) ** 2 for x in returns) / group_size)
            columns.append([0.0 if max(returns) == min(returns) else (x - mean) / (std + eps) for x in returns])
        out += [[columns[u][i - g] for u in range(len(turns[i]))] for i in group]
    return out


def test_turn_returns_match_the_formula_and_reduce_to_eq6():
    rollouts = GROUP0 + GROUP1
    turns = [r.extra["turn_rewards"] for r in rollouts]
    adv = turn_return_advantages(REWARDS, turns, 3)
    assert adv.dtype == torch.float32 and adv.shape == (6, 3)
    for i, expected in enumerate(_by_hand(rollouts, REWARDS, 3)):
        assert adv[i, : len(expected)].tolist() == pytest.approx(expected, abs=1e-6), i
    # The first turn's advantage is Eq.6's A_i bit for bit (fp32 as the trainer computes it, and fp64);
    # only-last-turn rewards give every turn A_i.
    assert torch.equal(adv[:, 0], group_advantages(REWARDS, 3))
    assert torch.equal(turn_return_advantages(REWARDS.double(), turns, 3)[:, 0], group_advantages(REWARDS.double(), 3))
    for i in (3, 4, 5):
        n = len(rollouts[i].extra["turn_rewards"])
        assert torch.equal(adv[i, :n], adv[i, :1].expand(n)), i
    # The shaped group's turns differ (the trajectory 0's answer turn earns less credit than its first turn).
    assert adv[0, 0] != adv[0, 1]
    assert torch.equal(turn_return_advantages(torch.ones(3), [[0.5, 0.5]] * 3, 3), torch.zeros(3, 2))  # no signal
    with pytest.raises(ValueError, match=r"rewards must be \[B\] with one entry per trajectory's turn rewards \(3\)"):
        turn_return_advantages(torch.ones(2), [[1.0]] * 3, 3)
    with pytest.raises(ValueError, match="trajectory 1 has no turn rewards"):
        turn_return_advantages(torch.ones(3), [[1.0], [], [1.0]], 3)
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        turn_return_advantages(torch.ones(3), [[1.0]] * 3, 4)


def test_rewarded_earlier_turns_do_not_push_later_turns_down():
    """The reviewer's case: every trajectory earns 0.25 for its tool call, the answers 1, 1, 1 and 0.99. Written by
    hand: the totals 1.25, 1.25, 1.25, 1.24 have mean 1.2475 and std sqrt(3) * 0.0025; the answer turns' returns
    1, 1, 1, 0.99 have mean 0.9975 and the same std. So both turns get +1/sqrt(3) for the first three and -sqrt(3)
    for the fourth (a baseline of the TOTAL rewards' mean gave the answer turns (1 - 1.2475) / 0.00433 = -57.2)."""
    turns = [[0.25, 1.0], [0.25, 1.0], [0.25, 1.0], [0.25, 0.99]]
    rewards = torch.tensor([1.25, 1.25, 1.25, 1.24], dtype=torch.float64)
    adv = turn_return_advantages(rewards, turns, 4, eps=0.0)
    expected = [[3**-0.5, 3**-0.5]] * 3 + [[-(3**0.5), -(3**0.5)]]
    assert adv.tolist() == [pytest.approx(row, rel=1e-9) for row in expected]
    # A trajectory that ended earlier counts with its last turn's return: trajectory 1 answered in one turn
    # (reward 1), the others earned 0.5 for a tool call and then 0, 0.5, 0.5. Turn 1: returns 0.5, 1, 1, 1 (mean
    # 0.875, std sqrt(3)/8) -> -sqrt(3), 1/sqrt(3) x 3; turn 2: 0, 1, 0.5, 0.5 (mean 0.5, std 1/sqrt(8)) -> -sqrt(2),
    # sqrt(2), 0, 0.
    turns = [[0.5, 0.0], [1.0], [0.5, 0.5], [0.5, 0.5]]
    adv = turn_return_advantages(torch.tensor([0.5, 1.0, 1.0, 1.0], dtype=torch.float64), turns, 4, eps=0.0)
    assert adv[:, 0].tolist() == pytest.approx([-(3**0.5), 3**-0.5, 3**-0.5, 3**-0.5], rel=1e-9)
    assert adv[:, 1].tolist() == pytest.approx([-(2**0.5), 2**0.5, 0.0, 0.0], rel=1e-9, abs=1e-12)


def _packed(rollouts, rewards):
    token_adv = turn_token_advantages(rollouts, rewards, 3)
    batch = pack_rollouts(rollouts, SEQ, PAD, rewards, group_advantages(rewards, 3), token_advantages=token_adv)
    return token_adv, batch


def test_each_model_token_gets_its_turns_advantage_in_the_training_layout():
    rollouts = GROUP0 + GROUP1
    token_adv, batch = _packed(rollouts, REWARDS)
    hand = _by_hand(rollouts, REWARDS, 3)
    adv_NS = batch.extra["token_advantages_NS"]
    for i, r in enumerate(rollouts):
        turn = -1
        for p, m in enumerate(r.loss_mask):
            turn += p in r.extra["turn_starts"]
            expected = hand[i][turn] if m else 0.0  # environment tokens: never trained on, no advantage
            assert token_adv[i][p] == pytest.approx(expected, abs=1e-6), (i, p)
            # Label position of response token p: len(prompt) - 1 + p, where the loss mask marks it.
            assert float(adv_NS[i, 2 + p]) == pytest.approx(expected, abs=1e-6)
            assert bool(batch.loss_mask_NS[i, 2 + p]) == bool(m)
    assert float(adv_NS[~batch.loss_mask_NS].abs().sum()) == 0
    with pytest.raises(ValueError, match="needs multi-turn trajectories; rollout 0 has no per-turn rewards"):
        turn_token_advantages([Rollout([1], [2], [0.0], "stop")] * 3, torch.zeros(3), 3)


def _logprobs(batch, seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(batch.loss_mask_NS.shape, generator=g, dtype=torch.float64) * 0.1 - 2.0
    # Per-sequence offsets: some sequences clip at GSPO's range, some do not.
    offsets = torch.tensor([2e-3, -2e-3, 1e-4, -1e-4, 3e-4, 5e-4], dtype=torch.float64)[:, None]
    lp = (old + offsets + 1e-4 * torch.randn(old.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    return lp, old


def test_gspo_token_with_per_turn_advantages_has_eq17s_gradient():
    rollouts = GROUP0 + GROUP1
    _, batch = _packed(rollouts, REWARDS)
    lp, old = _logprobs(batch, 3)
    mask, adv = batch.loss_mask_NS, batch.extra["token_advantages_NS"].double()
    out = gspo_token_loss(lp, old, adv, mask, num_sequences=6)
    (grad,) = torch.autograd.grad(out.loss, lp)
    # Eq.17 in closed form with the hand-made A_i,u(t), independently of the packed tensor.
    hand_BT = torch.zeros(mask.shape, dtype=torch.float64)
    hand = _by_hand(rollouts, REWARDS, 3)
    for i, r in enumerate(rollouts):
        turn = -1
        for p in range(len(r.response_ids)):
            turn += p in r.extra["turn_starts"]
            hand_BT[i, 2 + p] = hand[i][turn]
    expected = ref.gspo_token_grad(lp, old, hand_BT, mask, 3e-4, 4e-4, n=6)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)
    # Trajectory 2 (unclipped): its three turns' tokens weigh as their advantages do, not as one A_i.
    g2 = [float(grad[2, 2 + p]) for p in (0, 5, 9)]  # a token of each model turn
    assert g2[0] != 0 and g2[0] != g2[1] and g2[1] != g2[2]
    assert g2[1] / g2[0] == pytest.approx(hand[2][1] / hand[2][0], rel=1e-6)
    lp_ref = lp.detach().clone().requires_grad_(True)
    torch.testing.assert_close(out.loss.double(), ref.gspo_token_objective(lp_ref, old, hand_BT, mask, 3e-4, 4e-4,
                                                                           n=6), rtol=1e-6, atol=1e-9)


def test_equal_per_turn_advantages_make_gspo_token_equal_gspo():
    """Only the last turn rewarded: every turn's advantage is A_i and GSPO-token's loss, clipping and gradient are
    GSPO's (paper Eq.17 with A_i,t = A_i)."""
    rollouts = GROUP1 * 2  # two groups of only-last-turn rewards
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    _, batch = _packed(rollouts, rewards)
    lp, old = _logprobs(batch, 4)
    mask = batch.loss_mask_NS
    tok = gspo_token_loss(lp, old, batch.extra["token_advantages_NS"].double(), mask)
    (grad_tok,) = torch.autograd.grad(tok.loss, lp)
    seq = gspo_loss(lp, old, batch.advantages_N.double(), mask)
    (grad_seq,) = torch.autograd.grad(seq.loss, lp)
    # fp32 advantages as trained: every turn's A_i,u is the trainer's A_i bit for bit.
    token_adv = batch.extra["token_advantages_NS"]
    assert torch.equal(token_adv, batch.advantages_N[:, None].expand_as(token_adv) * mask)
    torch.testing.assert_close(tok.loss, seq.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_tok, grad_seq, rtol=1e-12, atol=0)
    assert grad_seq.abs().sum() > 0
    for key in ("clip_frac_low_seq", "clip_frac_high_seq"):
        assert float(tok.metrics[key]) == pytest.approx(float(seq.metrics[key]))
    assert float(seq.metrics["clip_frac_low_seq"]) + float(seq.metrics["clip_frac_high_seq"]) > 0
