"""Multi-turn, tool-using rollouts: trajectories of model turns and environment turns as token ids, with a loss
mask over the model's tokens (driver.py), environments from gymnasium (environment.py), a calculator tool
(calculator.py), and the `multiturn.*` config (config.py)."""

from megatron_gspo.rollout.multiturn.config import MultiTurnConfig
from megatron_gspo.rollout.multiturn.driver import MultiTurnRollouts, make_multiturn, trajectory_stats
from megatron_gspo.rollout.multiturn.environment import EnvFailure, env_factory
from megatron_gspo.rollout.multiturn.turn_advantages import turn_token_advantages

__all__ = ["EnvFailure", "MultiTurnConfig", "MultiTurnRollouts", "env_factory", "make_multiturn", "trajectory_stats",
           "turn_token_advantages"]
