"""Reward functions by name, and the scorer that applies one to a batch without ever crashing the run.

A reward function maps (response text, reference answer, meta) to a float. Built-ins register themselves
under a name (`@register_reward("exact_match")`); a user function is named by its import path,
`my_pkg.rewards:score`. (torch is imported only where a batch is scored, so reward worker processes start
without it.)
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from megatron_gspo.rewards.config import ScoringConfig
from megatron_gspo.rewards.pool import Outcome, RewardPool, call_reward

if TYPE_CHECKING:
    import torch

RewardFn = Callable[[str, str, dict], float]
"""(response text, reference answer, meta) -> reward."""

logger = logging.getLogger(__name__)

# Name -> function. Filled at import time by the built-in reward modules (imported by the package __init__)
# and by user code that calls `register_reward`; nothing else writes to it.
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator that makes a reward function available to `get_reward(name)`."""
    if not name or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':' (it marks module paths)")

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        # Re-registering the same function (module reloaded) is harmless; another one would silently shadow.
        if existing is not None and _qualname(existing) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered to {_qualname(existing)}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def registered_rewards() -> list[str]:
    """Names usable with `get_reward`, sorted."""
    return sorted(_REGISTRY)


def get_reward(name_or_path: str) -> RewardFn:
    """The reward function registered as `name_or_path`, or imported from a `module:function` path."""
    if ":" not in name_or_path:
        fn = _REGISTRY.get(name_or_path)
        if fn is None:
            raise ValueError(
                f"unknown reward {name_or_path!r}; registered: {', '.join(registered_rewards())} "
                "(or give a user function as 'module:function')"
            )
        return fn
    module_name, attr_path = _split_path(name_or_path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or any error raised while the user's module runs
        raise ValueError(
            f"reward {name_or_path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward {name_or_path!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {name_or_path!r}: {attr_path!r} is a {type(obj).__name__}, not a function")
    return obj


def check_reward_spec(spec: str, key: str = "reward") -> None:
    """Raises ValueError unless `spec` is a registered name or has the form `module:function`."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key}={spec!r} must be a reward name or 'module:function'")
    if ":" in spec:
        _split_path(spec, key)
    elif spec not in _REGISTRY:
        raise ValueError(
            f"{key}={spec!r} is not a registered reward; use one of {', '.join(registered_rewards())} "
            "or 'module:function'"
        )


def _split_path(spec: str, key: str = "reward") -> tuple[str, str]:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{key}={spec!r} must look like 'package.module:function'")
    return module_name, attr_path


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class RewardScorer:
    """Applies a reward function to a batch; an item whose function fails (raises, calls sys.exit, returns a
    non-number or a non-finite value, or runs past the timeout) scores 0.

    Such items are counted (`num_errors` over the scorer's life, `last_metrics['reward_errors']` for the last
    call, `take_window()` since the last window) and the first one is logged with its traceback, once: one buggy
    reward call must show up in the metrics, not stop a multi-day run (the trainer fails a step whose error
    fraction reaches `scoring.max_error_frac`).

    With `scoring.workers > 0` calls run in worker processes with a per-call timeout (rewards/pool.py); without a
    `scoring` config, or for a function that cannot be sent to a worker, they run in this process.
    """

    def __init__(
        self,
        fn: RewardFn | str,
        name: str | None = None,
        *,
        scoring: ScoringConfig | None = None,
        pool: RewardPool | None = None,
    ) -> None:
        self.fn: RewardFn = get_reward(fn) if isinstance(fn, str) else fn
        self.name = name or (fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn)))
        _check_signature(self.fn, self.name)
        self.pool = pool
        self._owns_pool = False
        if pool is None and scoring is not None and scoring.workers > 0:
            if RewardPool.supports(self.fn):
                self.pool = RewardPool(self.fn, workers=scoring.workers, timeout_s=scoring.timeout_s, name=self.name,
                                       slow_warning_s=scoring.slow_warning_s)
                self._owns_pool = True
            else:
                logger.warning(
                    "reward %r cannot be sent to a worker process (not a module-level function): it runs in the "
                    "trainer process, without scoring.timeout_s",
                    self.name,
                )
        self.num_errors = 0
        self.num_scored = 0
        self.last_metrics: dict[str, float] = {}
        self._logged_error = False
        self._window = [0, 0, None]  # calls, errors, first error message

    def sharing(self) -> RewardScorer:
        """A scorer of the same function and worker pool with its own counters (e.g. for evaluation)."""
        other = RewardScorer(self.fn, self.name, pool=self.pool)
        other._logged_error = self._logged_error
        return other

    def score(
        self, responses: Sequence[str], answers: Sequence[str], metas: Sequence[dict] | None = None
    ) -> torch.Tensor:
        """Rewards of the batch, float32 [B]; also sets `last_metrics` (reward_mean, reward_errors)."""
        import torch

        if metas is None:
            metas = [{} for _ in responses]
        if not len(responses) == len(answers) == len(metas):
            raise ValueError(
                f"score() got {len(responses)} responses, {len(answers)} answers and {len(metas)} metas; "
                "they must line up one to one"
            )
        items = list(zip(responses, answers, metas))
        if self.pool is not None:
            outcomes = self.pool.map(items)
        else:
            outcomes = [call_reward(self.fn, r, a, m) for r, a, m in items]
        errors = 0
        for index, outcome in enumerate(outcomes):
            if outcome.error is not None:
                errors += 1
                self._log_first_error(index, responses[index], outcome)
                if self._window[2] is None:
                    self._window[2] = f"reward {self.name!r} failed on {responses[index]!r:.60}: {outcome.error}"
        values = [o.value for o in outcomes]
        self.num_errors += errors
        self.num_scored += len(values)
        self._window[0] += len(values)
        self._window[1] += errors
        rewards = torch.tensor(values, dtype=torch.float32)
        self.last_metrics = {
            "reward_mean": rewards.mean().item() if values else 0.0,
            "reward_errors": float(errors),
        }
        return rewards

    def count_external(self, values: Sequence[float], errors: Sequence[str]) -> None:
        """Counts rewards scored elsewhere, `errors` the failures among them (a multi-turn environment that raised,
        hung or returned garbage, rollout/multiturn/), as this scorer's own calls: in `last_metrics`, the window
        and `num_errors`, so they meet `scoring.max_error_frac` as failing reward calls do."""
        self.num_errors += len(errors)
        self.num_scored += len(values)
        self._window[0] += len(values)
        self._window[1] += len(errors)
        if self._window[2] is None and errors:
            self._window[2] = errors[0]
        self.last_metrics = {"reward_mean": sum(values) / len(values) if values else 0.0,
                             "reward_errors": float(len(errors))}

    def take_window(self) -> tuple[int, int, str | None]:
        """(calls, failed calls, the first failure's message) since the previous `take_window`."""
        calls, errors, first = self._window
        self._window = [0, 0, None]
        return calls, errors, first

    def add_window(self, calls: int, errors: int, first: str | None) -> None:
        """Counts another scorer's window in this one's (the rollout producer scores with a `sharing()` scorer in
        its own thread; the training stage adds each batch's window when it takes the batch)."""
        self._window[0] += calls
        self._window[1] += errors
        if self._window[2] is None:
            self._window[2] = first

    def close(self) -> None:
        """Stops the worker processes this scorer started (a `sharing()` scorer leaves them to their owner)."""
        if self._owns_pool and self.pool is not None:
            self.pool.close()

    def _log_first_error(self, index: int, response: str, outcome: Outcome) -> None:
        if self._logged_error:
            return
        self._logged_error = True
        logger.warning(
            "reward %r failed on batch item %d (response %.80r): %s; it scores 0, and later failures are "
            "only counted (metric reward_errors)%s",
            self.name,
            index,
            response,
            outcome.error,
            f"\n{outcome.detail.rstrip()}" if outcome.detail else "",
        )


def _check_signature(fn: Any, name: str) -> None:
    """A reward is called as fn(response, answer, meta): refuse one that cannot take that, before training."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some callables have no signature to check
        return
    try:
        signature.bind("", "", {})
    except TypeError as err:
        raise ValueError(
            f"reward {name!r} has the signature {signature}, but rewards are called as fn(response, answer, meta) "
            f"({err})"
        ) from None
