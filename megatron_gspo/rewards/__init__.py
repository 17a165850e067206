"""Reward functions: a name -> function registry (plus `module:function` user functions) and a fault-tolerant
batch scorer. Importing the package registers the built-ins: exact_match, boxed_exact_match, math_verify."""

from megatron_gspo.rewards import exact_match as _exact_match  # noqa: F401  (registers built-ins)
from megatron_gspo.rewards import math as _math  # noqa: F401  (registers built-ins)
from megatron_gspo.rewards.registry import (
    RewardFn,
    RewardScorer,
    check_reward_spec,
    get_reward,
    register_reward,
    registered_rewards,
)

__all__ = [
    "RewardFn",
    "RewardScorer",
    "check_reward_spec",
    "get_reward",
    "register_reward",
    "registered_rewards",
]
