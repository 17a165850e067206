"""Errors of every HTTP rollout-server engine (SGLang, vLLM), one line each: which server, which call, what.

`retryable` tells the shared request loop (server/engine.py) whether another attempt can help.
"""

from __future__ import annotations

import json
from typing import Any

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses worth retrying: overload, internal errors, a server starting or going away."""


class ServerError(RuntimeError):
    """Base class of every error a server engine raises."""

    retryable: bool = False


class ServerConnectionError(ServerError):
    """The server could not be reached, dropped the connection, or did not answer in time."""

    retryable = True

    def __init__(
        self, url: str, path: str, cause: BaseException | str, *, timed_out: bool = False, kind: str = ""
    ):
        self.url, self.path, self.timed_out = url, path, timed_out
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{server_label(kind, url)}{path}: {detail}")


class ServerHTTPError(ServerError):
    """The server answered with a non-2xx status."""

    def __init__(self, url: str, path: str, status: int, body: str, *, kind: str = ""):
        self.url, self.path, self.status, self.body = url, path, status, body
        self.retryable = status in RETRYABLE_STATUSES
        snippet = " ".join(body.split())[:300]
        super().__init__(f"{server_label(kind, url)}{path} answered HTTP {status}: {snippet}")


class ServerResponseError(ServerError):
    """A 2xx response whose body does not have the documented shape (one line: server URL + the problem)."""

    def __init__(self, url: str, problem: str, *, retryable: bool = False, kind: str = ""):
        self.url, self.problem = url, problem
        self.retryable = retryable
        super().__init__(f"{server_label(kind, url)}: {problem}")


class GenerateError(ServerError):
    """A sample could not be produced within the retry budget; no partial batch is ever returned."""


class StaleWeightsError(ServerError):
    """A server produced a sample with weights older than the engine's current version."""


def server_label(kind: str, url: str) -> str:
    """'SGLang server http://h:1' (kind names the engine; empty: 'server ...')."""
    return f"{kind} server {url}" if kind else f"server {url}"


def parse_json_body(raw: bytes, url: str, path: str, *, kind: str = "") -> Any:
    """Decodes a response body; malformed JSON is a (retryable: the body may be truncated) one-line error."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        snippet = raw[:80].decode("utf-8", "replace")
        problem = f"{path} returned malformed JSON ({e.__class__.__name__}: {e}); body starts {snippet!r}"
        raise ServerResponseError(url, problem, retryable=True, kind=kind) from None
