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


def turn_return_advantages(turn_rewards_BU: torch.Tensor, group_size: int, *, eps: float = 1e-6) -> torch.Tensor:
    """Per-turn advantages of multi-turn trajectories for GSPO-token's A_i,t (Eq.13-14; the paper's motivating use:
    "finer-grained advantage adjustment" in multi-turn RL), fp32 [B, U]:

        A_i,u = (R_i,u - mean_j R_j,1) / (std_j R_j,1 + eps),   R_i,u = sum_{u' >= u} r_i,u'

    r_i,u is the reward of trajectory i's turn u (its environment step; `turn_rewards_BU` zero-padded after a
    trajectory's last turn), R_i,u the return from turn u on, mean / std over the group of trajectory returns
    R_j,1 = r_j, i.e. Eq.6's baseline and scale. Why this form: a turn is credited only with what follows it (it
    cannot change earlier rewards), and the first turn's advantage is Eq.6's A_i, so when only the last turn is
    rewarded every turn gets A_i and GSPO-token is exactly GSPO (Eq.17 with A_i,t = A_i), the property the paper
    states; a per-turn-index normalisation would not reduce to it (trajectories have different numbers of
    turns). Groups whose returns are all equal carry no signal: 0, as in `group_advantages`. Entries past a
    trajectory's last turn are meaningless (no token reads them). Detached.
    """
    if turn_rewards_BU.dim() != 2:
        raise ValueError(f"turn_rewards must be [B, U], got shape {tuple(turn_rewards_BU.shape)}")
    with torch.no_grad():
        r_BU = turn_rewards_BU.detach().to(compute_dtype(turn_rewards_BU))
        returns_BU = r_BU.flip(-1).cumsum(-1).flip(-1)
        if returns_BU.shape[1] == 0:
            raise ValueError("turn_rewards has no turns: every trajectory has at least one model turn")
        a_B = group_advantages(returns_BU[:, 0], group_size, eps=eps)  # Eq.6 of the returns; checks the grouping
        total_GK = returns_BU[:, 0].reshape(-1, group_size)
        mean_G1, std_G1 = total_GK.mean(-1, keepdim=True), total_GK.std(-1, correction=0, keepdim=True)
        flat_G1 = total_GK.amax(-1, keepdim=True) == total_GK.amin(-1, keepdim=True)
        u = returns_BU.shape[1]
        adv_GKU = (returns_BU.reshape(-1, group_size, u) - mean_G1[..., None]) / (std_G1[..., None] + eps)
        adv_BU = torch.where(flat_G1[..., None], 0.0, adv_GKU).reshape(-1, u)
        adv_BU[:, 0] = a_B  # the first turn's return is the trajectory's: Eq.6's A_i to the bit
        return adv_BU
