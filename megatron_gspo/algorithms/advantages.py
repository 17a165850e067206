"""Group-relative advantages (paper Eq.6), shared by GSPO and GRPO.

Legend: B = responses, G = groups (prompts), K = responses per group (group_size), B = G * K; U = turns of a
multi-turn trajectory.
"""

from __future__ import annotations

import torch

from megatron_gspo.algorithms.ratios import compute_dtype


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages, Eq.6: A_i = (r_i - mean(r_group)) / std(r_group).

    `rewards` is [B] with B = n_groups * group_size, the responses of each prompt stored contiguously. std
    is the population standard deviation (divide by the group size: the literal std of the group's rewards,
    defined for a group of 1), and the division is by std + `eps` so near-constant groups stay bounded.
    `normalize_std=False` returns r_i - mean(r_group) (Dr. GRPO style). Groups whose rewards are all equal
    carry no learning signal: their advantages are exactly 0 (never NaN, and never the rounding noise of
    r - mean(r) blown up by a tiny std). Returns [B], fp32 (fp64 for fp64 rewards), detached.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size} "
            "(each prompt's responses must be grouped contiguously)"
        )
    if eps < 0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    with torch.no_grad():
        rewards_GK = rewards.detach().to(compute_dtype(rewards)).reshape(-1, group_size)
        centred_GK = rewards_GK - rewards_GK.mean(dim=-1, keepdim=True)
        if normalize_std:
            std_G1 = rewards_GK.std(dim=-1, correction=0, keepdim=True)
            centred_GK = centred_GK / (std_G1 + eps)
        constant_G1 = rewards_GK.amax(dim=-1, keepdim=True) == rewards_GK.amin(dim=-1, keepdim=True)
        return torch.where(constant_G1, 0.0, centred_GK).reshape(-1)


def turn_return_advantages(
    rewards_B: torch.Tensor, turn_rewards: list[list[float]], group_size: int, *, eps: float = 1e-6
) -> torch.Tensor:
    """Per-turn advantages of multi-turn trajectories for GSPO-token's A_i,t (Eq.13-14, REFERENCE.md §1; the paper's
    motivating use: "finer-grained advantage adjustment" in multi-turn RL), [B, U] in `rewards_B`'s compute dtype:

        A_i,u = Eq.6 over the group j of R_j,min(u, L_j),   R_i,u = r_i - sum_{u' < u} r_i,u'

    r_i is trajectory i's reward (what Eq.6's A_i is computed from: the environment's total plus e.g. DAPO's
    overlong penalty), r_i,u the reward of its turn u (`turn_rewards[i]`, its L_i environment steps), R_i,u the
    return from turn u on (whatever r_i adds to the turn rewards' sum falls to the last turn). Each turn is
    baselined and scaled by the group's returns AT THAT TURN (a trajectory that ended before turn u counts with
    its last turn's return): a turn is credited only with what follows it, against what the group earned from
    the same point on. Baselining a later turn's return by the group mean of TOTAL rewards instead would push
    every later turn down by the mean reward of the turns before it, divided by a std that may be tiny. Eq.6
    per turn keeps |A_i,u| <= sqrt(K - 1) like A_i, and a turn whose returns are equal across the group is 0.
    When only the last turn is rewarded every R_i,u = r_i, so every turn gets A_i bit for bit and GSPO-token is
    exactly GSPO (Eq.17 with A_i,t = A_i, the property the paper states); the first turn's return is r_i itself,
    so its advantage is always A_i bit for bit. Entries past a trajectory's last turn repeat its last turn's and
    are read by no token. Detached.
    """
    if rewards_B.dim() != 1 or rewards_B.numel() != len(turn_rewards):
        raise ValueError(f"rewards must be [B] with one entry per trajectory's turn rewards ({len(turn_rewards)}), "
                         f"got shape {tuple(rewards_B.shape)}")
    num_turns_B = torch.tensor([len(own) for own in turn_rewards], dtype=torch.long)
    if bool((num_turns_B < 1).any()):
        raise ValueError(f"trajectory {int((num_turns_B < 1).nonzero()[0])} has no turn rewards: every trajectory "
                         "has at least one model turn")
    with torch.no_grad():
        width = int(num_turns_B.max()) if len(turn_rewards) else 1
        turn_BU = torch.zeros(len(turn_rewards), width, dtype=torch.float64)
        for i, own in enumerate(turn_rewards):
            turn_BU[i, : len(own)] = torch.tensor([float(x) for x in own], dtype=torch.float64)
        before_BU = turn_BU.cumsum(-1) - turn_BU  # rewards earned before turn u
        at_BU = torch.minimum(torch.arange(width)[None, :], num_turns_B[:, None] - 1)  # past the end: the last turn
        # fp64 arithmetic rounded to the rewards' dtype: the first turn's return is r_i exactly, so Eq.6 below
        # is the trainer's A_i to the bit.
        returns_BU = (rewards_B.detach().double()[:, None] - before_BU.gather(1, at_BU)).to(compute_dtype(rewards_B))
        columns = [group_advantages(returns_BU[:, u].contiguous(), group_size, eps=eps) for u in range(width)]
        return torch.stack(columns, dim=-1)
