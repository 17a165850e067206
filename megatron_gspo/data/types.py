"""The unit every prompt source produces: a prompt, its reference answer, and free-form metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DatasetError(ValueError):
    """Bad prompt data; the message starts with where it is (`file:line:` or `file: row N:`)."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt with the reference answer a reward function checks responses against.

    Frozen because datasets hand out the same item every epoch: callers that want to add per-rollout facts
    build a new dict (`{**item.meta, "finish_reason": ...}`) rather than writing into `meta`.
    """

    prompt: str
    """Text given to the policy (after any prompt template)."""
    answer: str
    """Reference answer, always a string (numbers in the source are converted with `str`)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Extra fields of the source row (e.g. task name, split, raw prompt); passed to the reward function."""
