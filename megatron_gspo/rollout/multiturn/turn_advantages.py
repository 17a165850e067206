"""Per-turn advantages of multi-turn trajectories (`multiturn.advantage=turn_return`): each model token gets the
advantage of its turn, A_i,t = A_i,u(t) (algorithms/advantages.py `turn_return_advantages`), for GSPO-token's
per-token advantages (Eq.13-14) or GRPO's; GSPO's sequence ratio keeps one advantage per trajectory (Eq.6)."""

from __future__ import annotations

import bisect

import torch

from megatron_gspo.algorithms import turn_return_advantages
from megatron_gspo.rollout.types import Rollout


def turn_token_advantages(rollouts: list[Rollout], rewards_B: torch.Tensor, group_size: int) -> list[list[float]]:
    """Per response token of each trajectory, the advantage of the model turn it belongs to (0 on environment
    tokens, which are never trained on). Turn rewards are `extra['turn_rewards']` (the environment's per step);
    what `rewards_B` adds to their sum (DAPO's overlong penalty; a failed sample's 0) goes to the last turn, so
    the first turn's return is the reward GSPO's A_i is computed from and its advantage is A_i bit for bit."""
    missing = [i for i, r in enumerate(rollouts) if "turn_rewards" not in r.extra or "turn_starts" not in r.extra]
    if missing:
        raise ValueError(f"multiturn.advantage=turn_return needs multi-turn trajectories; rollout {missing[0]} has "
                         "no per-turn rewards (extra['turn_rewards'])")
    adv_BU = turn_return_advantages(rewards_B, [r.extra["turn_rewards"] for r in rollouts], group_size)
    out = []
    for i, r in enumerate(rollouts):
        starts, mask = r.extra["turn_starts"], r.loss_mask or [1] * len(r.response_ids)
        out.append([float(adv_BU[i, bisect.bisect_right(starts, p) - 1]) if m else 0.0 for p, m in enumerate(mask)])
    return out
