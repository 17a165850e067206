"""Environments for runs that load them by name (`multiturn.env=tests.rollout.multiturn.envs:DigitsEnv`)."""

import gymnasium


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
