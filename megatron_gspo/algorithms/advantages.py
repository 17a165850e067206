"""Group-relative advantages (paper Eq.6), shared by GSPO and GRPO.

Legend: B = responses, G = groups (prompts), K = responses per group (group_size), B = G * K.
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
