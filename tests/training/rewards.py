"""Reward functions for tests, loaded by `module:function` path (nonzero on an untrained model)."""


def contains_one(response: str, answer: str, meta: dict) -> float:
    return 1.0 if "1" in response else 0.0
