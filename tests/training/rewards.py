"""Reward functions for tests, loaded by `module:function` path (nonzero on an untrained model)."""


def contains_one(response: str, answer: str, meta: dict) -> float:
    return 1.0 if "1" in response else 0.0


def fails_on_odd_answers(response: str, answer: str, meta: dict) -> float:
    """Raises for every response of a prompt whose answer ends in an odd digit (a flat, all-error group);
    otherwise rewards a '1' in the response."""
    if int(answer[-1]) % 2:
        raise ValueError("odd answer")
    return 1.0 if "1" in response else 0.0
