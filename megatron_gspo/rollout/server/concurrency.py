"""Async helpers of the server engines: blocking calls in daemon threads, gathers that cancel on failure."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs a blocking call (a group join, a broadcast) in a daemon thread: if the other side never shows up,
    the thread waits out the group's timeout without keeping the process from exiting (unlike to_thread)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args, **kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop was closed meanwhile: nobody waits for this any more
            pass

    name = f"weight-sync-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


async def all_or_first_error(futures: list[asyncio.Future]) -> None:
    """Waits for all; on the first failure cancels the others and raises it (a thread blocked in a collective
    cannot be cancelled: it ends at the group's timeout)."""
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    for fut in done:
        if fut.exception() is not None:
            for other in pending:
                other.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
            raise fut.exception()  # type: ignore[misc]


async def gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """asyncio.gather that cancels (and waits for) the others when one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
