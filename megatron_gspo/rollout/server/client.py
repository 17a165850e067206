"""Async HTTP client of every server engine: timeouts, retries with exponential backoff, health polling.

Connection errors, timeouts and the statuses in `RETRYABLE_STATUSES` (5xx, 429) are retried; other 4xx are our
bug or a real refusal and raise at once. Callers that know a 4xx is transient (e.g. `/flush_cache` answers 400
while requests are running) pass their own `retry_statuses`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

import aiohttp

from megatron_gspo.rollout.server.errors import (
    RETRYABLE_STATUSES,
    ServerConnectionError,
    ServerError,
    ServerHTTPError,
    ServerResponseError,
    server_label,
)

logger = logging.getLogger(__name__)


def progress_every_s(timeout_s: float) -> float:
    """How often a wait for a server reports: every 30 s, or a quarter of a shorter time limit (at least 1 s)."""
    return max(1.0, min(30.0, timeout_s / 4))


MAX_BACKOFF_S = 30.0


def backoff_delay(base_s: float, attempt: int, cap_s: float = MAX_BACKOFF_S) -> float:
    """Delay before retry number `attempt` (0-based): base * 2**attempt, capped."""
    return min(cap_s, base_s * (2**attempt))


class HTTPClient:
    """One aiohttp session shared by all requests to all servers (created lazily inside the running loop).

    `kind` names the engine in every error ('SGLang server http://...: ...').
    """

    def __init__(
        self, *, timeout_s: float, max_retries: int, backoff_s: float, max_connections: int = 256, kind: str = ""
    ):
        self.kind = kind
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections + 16, force_close=False)
            # Each request carries its own timeout; the session has none (a generation can take minutes).
            no_limit = aiohttp.ClientTimeout(total=None)
            self._session = aiohttp.ClientSession(connector=connector, timeout=no_limit)
        return self._session

    async def close(self) -> None:
        """Closes the session (idempotent)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request_once(
        self,
        url: str,
        path: str,
        payload: Any = None,
        *,
        method: str = "POST",
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """One HTTP exchange; connection failures and timeouts become ServerConnectionError."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if payload is not None:
            kwargs["json"] = payload
        try:
            async with self._get_session().request(method, url + path, **kwargs) as resp:
                return resp.status, await resp.read()
        except TimeoutError:
            message = f"no answer within {timeout.total:g} s"
            raise ServerConnectionError(url, path, message, timed_out=True, kind=self.kind) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise ServerConnectionError(url, path, e, kind=self.kind) from None

    async def request(
        self,
        url: str,
        path: str,
        payload: Any = None,
        *,
        method: str = "POST",
        timeout_s: float | None = None,
        retries: int | None = None,
        retry_statuses: Collection[int] = RETRYABLE_STATUSES,
    ) -> bytes:
        """HTTP exchange with retries; returns the body of a 2xx answer or raises the last error."""
        retries = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                status, body = await self.request_once(url, path, payload, method=method, timeout_s=timeout_s)
                if 200 <= status < 300:
                    return body
                error: ServerError = ServerHTTPError(url, path, status, body.decode("utf-8", "replace"), kind=self.kind)
                transient = status in retry_statuses
            except ServerConnectionError as e:
                error, transient = e, True
            if not transient or attempt >= retries:
                raise error
            delay = backoff_delay(self.backoff_s, attempt)
            logger.warning("%s; retry %d/%d in %.2f s", error, attempt + 1, retries, delay)
            attempt += 1
            await asyncio.sleep(delay)

    async def call(self, url: str, path: str, payload: Any = None, **kwargs: Any) -> Any:
        """`request`, then the body decoded: JSON when it parses, else the text (None when empty).

        A JSON object with `"success": false` (SGLang's weight-update endpoints) raises with its message.
        """
        body = await self.request(url, path, payload, **kwargs)
        if not body.strip():
            return None
        try:
            decoded = json.loads(body)
        except ValueError:
            return body.decode("utf-8", "replace")
        if isinstance(decoded, dict) and decoded.get("success") is False:
            raise ServerResponseError(url, f"{path} failed: {decoded.get('message', decoded)}", kind=self.kind)
        return decoded

    async def wait_until_healthy(
        self,
        url: str,
        *,
        path: str,
        timeout_s: float,
        poll_s: float = 0.5,
        check_alive: Callable[[], str | None] | None = None,
    ) -> None:
        """Polls `path` until it answers 200. 503 and refused connections mean "still starting".

        `check_alive` returns an error message when the process behind `url` has died (launch mode), which
        ends the wait at once instead of at the timeout. The wait is announced at once and reported every
        `progress_every_s(timeout_s)` seconds (a server that never answers is otherwise a silent wait of up to
        `startup_timeout_s`).
        """
        start = time.monotonic()
        deadline = start + timeout_s
        label = server_label(self.kind, url)
        logger.info("waiting up to %g s for %s to answer GET %s", timeout_s, label, path)
        every = progress_every_s(timeout_s)
        next_report = start + every
        last = "no answer yet"
        while True:
            if check_alive is not None and (dead := check_alive()):
                raise ServerError(f"{server_label(self.kind, url)} did not start: {dead}")
            try:
                status, body = await self.request_once(url, path, method="GET", timeout_s=max(5.0, poll_s))
                if status == 200:
                    return
                last = f"HTTP {status}"
                if status not in (502, 503, 504):
                    raise ServerHTTPError(url, path, status, body.decode("utf-8", "replace"), kind=self.kind)
            except ServerConnectionError as e:
                last = str(e)
            now = time.monotonic()
            if now >= deadline:
                raise ServerError(f"{label} not healthy after {timeout_s:g} s (last: {last})")
            if now >= next_report:
                logger.warning("still waiting for %s (GET %s): %.0f s of %g s (last: %s)", label, path, now - start,
                               timeout_s, last)
                next_report = now + every
            await asyncio.sleep(poll_s)
