"""Math-answer reward: the response's last \\boxed{} answer checked against the gold one with `math_verify`.

math_verify compares symbolically / numerically (\\frac{1}{2} == 0.5 == 1/2, \\sqrt{8} == 2\\sqrt{2}, sets
up to order). Its timeouts arm SIGALRM, which only the main thread may do, and cancel it afterwards, which
would also cancel anyone else's alarm. So they are used only on the main thread while no other real-time timer
is armed (a watchdog, pytest-timeout); elsewhere math_verify runs without its own timeout rather than refusing
to run (off the main thread) or silently disarming the other timer.
"""

from __future__ import annotations

import functools
import signal
import threading

from megatron_gspo.rewards.exact_match import last_boxed
from megatron_gspo.rewards.registry import register_reward

TIMEOUT_S = 5
"""Seconds math_verify may spend parsing one expression or comparing one pair (main thread only)."""


def _timeout() -> int | None:
    """math_verify's timeout for this call: TIMEOUT_S where SIGALRM is ours to use, else None (no timeout)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return TIMEOUT_S


def _as_math(text: str) -> str:
    # math_verify's LaTeX extraction looks for delimited math: bare answers ("\frac{1}{2}", "0.5") get $...$.
    if "$" in text or "\\(" in text or "\\[" in text or "\\boxed" in text:
        return text
    return f"${text}$"


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> tuple:
    # Cached: every response of a group (G of them) is checked against the same gold answer.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    parsed = parse(
        _as_math(answer),
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )
    if not parsed:
        raise ValueError(f"math_verify cannot parse the reference answer {answer!r}")
    return tuple(parsed)


@register_reward("math_verify")
def math_verify(response: str, answer: str, meta: dict) -> float:
    """1.0 when the last \\boxed{} of the response is mathematically equal to `answer`, else 0.0.

    A response without a complete \\boxed{} scores 0.0. An unparseable reference answer raises ValueError (a
    data problem, which RewardScorer counts as a reward error).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return 0.0
    timeout = _timeout()
    gold = list(_parse_gold(answer.strip(), timeout))
    predicted = parse(
        f"${boxed}$",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )
    if not predicted:
        return 0.0
    return float(verify(gold, predicted, timeout_seconds=timeout))
