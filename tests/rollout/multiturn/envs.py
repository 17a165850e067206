"""Environments for runs that load them by name (`multiturn.env=tests.rollout.multiturn.envs:DigitsEnv`)."""

import os
import time

import gymnasium

from megatron_gspo.rollout.multiturn.calculator import CalculatorEnv


class DigitsEnv(gymnasium.Env):
    """For the built-in arithmetic alphabet: a turn ends at '='; every turn is answered with '00=' until the
    third, which ends the episode with reward 1 when the last turn's text equals the reference answer."""

    metadata = {"stop_texts": ("=",)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turns, self.answer = 0, (options or {}).get("answer")
        return "", {}

    def step(self, action):
        self.turns += 1
        if self.turns >= 3:
            return "", float(action == self.answer), True, False, {}
        return "00=", 0.0, False, False, {}


class ShapedFlakyCalculator(CalculatorEnv):
    """The character calculator with a per-turn reward and a deterministic failure, for training runs:
    - a tool call on a well-formed expression earns 0.25 at once (its turn's reward), the answer 1 if exact;
    - on prompts starting with 1, 2 or 3 the environment is down: its step raises, so about a third of the
      trajectories fail (the same ones in every run: what DP=2 and resumed runs must count alike)."""

    def __init__(self) -> None:
        super().__init__("chars")

    def reset(self, *, seed=None, options=None):
        self.prompt = (options or {}).get("prompt", "")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.prompt[:1] in ("1", "2", "3"):
            raise ConnectionError("calculator service unavailable")
        obs, reward, done, truncated, info = super().step(action)
        if not done:
            reward = 0.25 if obs != "=" else 0.0
        return obs, reward, done, truncated, info


class SlowSeededCalculator(CalculatorEnv):
    """The character calculator whose environment state comes from its seeded RNG and whose steps take a while,
    for the resume test: a tool call earns a bonus (1/8, 2/8 or 3/8) drawn from `np_random` at reset (gymnasium
    seeds it from reset's seed, which the driver derives from the step's seed), so a resumed run reproduces the
    rewards only if it reseeds the episodes it regenerates as the first run did. Every step sleeps 0.2 s and
    every call is appended to the file $MT_ENV_LOG (when set) with the process id, so the test can kill the run
    mid-episode."""

    def __init__(self) -> None:
        super().__init__("chars")

    def _log(self, what: str) -> None:
        path = os.environ.get("MT_ENV_LOG")
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {what}\n")

    def reset(self, *, seed=None, options=None):
        out = super().reset(seed=seed, options=options)
        self.bonus = float(self.np_random.integers(1, 4)) / 8
        self._log("reset")
        return out

    def step(self, action):
        time.sleep(0.2)
        obs, reward, done, truncated, info = super().step(action)
        self._log("step")
        return obs, (reward if done else self.bonus), done, truncated, info
