"""Environments of multi-turn rollouts are gymnasium environments (README "Multi-turn rollouts" says why this
library): `gymnasium.Env` with text actions and text observations, driven through its own API,

    reset(seed=..., options={"prompt": str, "answer": str, "meta": dict}) -> (observation, info)
    step(model_turn_text) -> (observation_text, reward, terminated, truncated, info)

The action is the text of one model turn (the ids the model sampled, decoded); the observation is the exact text
that follows it in the trajectory (a tool result with the chat markers around it and the opening of the model's
next turn), which the driver tokenises once and appends: the environment never sees or re-renders earlier turns.
An environment lists, in `metadata["stop_texts"]`, the texts (one token each) that end a model turn besides the
tokenizer's stop ids (e.g. the calculator's '?' after a call).

Every call runs in its own daemon thread under `multiturn.env_timeout_s`: an environment that raises, hangs or
returns garbage fails that one sample (`EnvFailure`), never the run, and a hung call's thread is left behind
without holding up the process's exit (Python cannot stop a thread: an environment that hangs on every call leaves
one sleeping thread per call; run such environments out of process).
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any


class EnvFailure(Exception):
    """An environment call that raised, timed out or returned something that is not a step."""


def call_all(calls: list[Callable[[], Any]], timeout_s: float) -> list[Any]:
    """Runs `calls` concurrently, each in a daemon thread; returns each one's value, or an `EnvFailure` in its
    place for a call that raised or was still running `timeout_s` after they all started."""
    results: list[Any] = [EnvFailure(f"no answer within multiturn.env_timeout_s={timeout_s:g} s")] * len(calls)

    def run(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = call()
        except Exception as exc:  # any error of a third-party environment fails its sample only
            results[i] = EnvFailure(f"raised {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"env-call-{i}") for i, c in
               enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    # A call finishing after the deadline must not overwrite its recorded failure: read the results now.
    return [results[i] if not t.is_alive() else EnvFailure(f"no answer within multiturn.env_timeout_s="
                                                              f"{timeout_s:g} s") for i, t in enumerate(threads)]


def checked_step(result: Any) -> tuple[str, float, bool]:
    """(observation, reward, done) of a gymnasium step result; EnvFailure naming what is wrong with garbage."""
    if isinstance(result, EnvFailure):
        raise result
    if not isinstance(result, tuple) or len(result) != 5:
        raise EnvFailure(f"step returned {type(result).__name__}, not (observation, reward, terminated, "
                         "truncated, info)")
    obs, reward, terminated, truncated, _ = result
    if not isinstance(obs, str):
        raise EnvFailure(f"step observation is {type(obs).__name__}, not text")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvFailure(f"step reward {reward!r} is not a number") from None
    if not math.isfinite(reward):
        raise EnvFailure(f"step reward {reward} is not finite")
    return obs, reward, bool(terminated) or bool(truncated)


def checked_reset(result: Any) -> None:
    """Raises EnvFailure unless `result` is gymnasium's (observation, info)."""
    if isinstance(result, EnvFailure):
        raise result
    if not isinstance(result, tuple) or len(result) != 2:
        raise EnvFailure(f"reset returned {type(result).__name__}, not (observation, info)")


def env_factory(name: str) -> Callable[[], Any]:
    """A factory of fresh environments for `multiturn.env`: a registered name or 'module:factory'."""
    from megatron_gspo.rollout.multiturn.calculator import ENVIRONMENTS

    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"multiturn.env={name!r} is not a registered environment ({', '.join(sorted(ENVIRONMENTS))}) "
                         "nor 'module:factory'")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"multiturn.env={name!r}: cannot load {attr!r} from module {module!r} ({exc})") from exc
    if not callable(factory):
        raise ValueError(f"multiturn.env={name!r}: {attr!r} is not callable")
    return factory
