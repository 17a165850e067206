"""Reward functions that misbehave, for the scorer / pool tests (module level, so worker processes import them)."""

import os
import sys
import time


def sleepy(response: str, answer: str, meta: dict) -> float:
    """Hangs (sleeps far past any test timeout) on responses starting with 'hang'; else exact match."""
    if response.startswith("hang"):
        time.sleep(600)
    return float(response == answer)


def slow(response: str, answer: str, meta: dict) -> float:
    """Takes 2 s on responses starting with 'slow' (below any timeout the tests set); else exact match."""
    if response.startswith("slow"):
        time.sleep(2.0)
    return float(response == answer)


def spins(response: str, answer: str, meta: dict) -> float:
    """Loops forever in pure Python on 'loop' (as sympy can); else 1."""
    while response == "loop":
        pass
    return 1.0


def exits(response: str, answer: str, meta: dict) -> float:
    """Calls sys.exit(3) on 'exit'."""
    if response == "exit":
        sys.exit(3)
    return 1.0


def dies(response: str, answer: str, meta: dict) -> float:
    """Ends its process on 'die' (as a crashing C extension would)."""
    if response == "die":
        os._exit(9)
    return 1.0


def stringly(response: str, answer: str, meta: dict):
    """Returns the reward as a string."""
    return "1.0"


def one_argument(response):
    return 1.0


def pid(response: str, answer: str, meta: dict) -> float:
    """The process id of the caller (tells in-process from worker calls)."""
    return float(os.getpid())
