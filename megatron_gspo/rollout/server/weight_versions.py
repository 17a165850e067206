"""Per-token weight versions as servers report them: spans `[{"version", "start", "end"}, ...]` over the output
tokens (vLLM 0.32 `choices[0].weight_versions`, SGLang >= 0.5.23 `meta_info.weight_versions`), which open a new
span where the weights changed during the generation (partial rollouts). Pure, shared by both protocols."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def expand_version_spans(spans: Any, num_tokens: int, parse: Callable[[Any], int]) -> list[int]:
    """The version of each of `num_tokens` tokens; the spans must tile [0, num_tokens) in order. `parse` turns a
    server's version label into an int. Raises ValueError saying what is wrong (the caller names the field)."""
    if not isinstance(spans, list) or not all(
        isinstance(s, dict) and "version" in s and type(s.get("start")) is int and type(s.get("end")) is int
        for s in spans
    ):
        raise ValueError(f"={spans!r} is not a list of {{version, start, end}}")
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions) or span["end"] < span["start"]:
            raise ValueError(f"={spans!r} leaves a gap or overlap at token {len(versions)}")
        versions += [parse(span["version"])] * (span["end"] - span["start"])
    if len(versions) != num_tokens:
        raise ValueError(f"={spans!r} covers {len(versions)} of {num_tokens} tokens")
    return versions
