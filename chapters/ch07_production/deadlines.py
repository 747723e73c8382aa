"""Deadlines and disconnects: how long one request may take, and when nobody waits for it any more.

A request past its deadline gets 504 (:func:`within_deadline`), one whose client hangs up 499 (:func:`until_disconnected`):
either way the handler's await is cancelled, so a queued request leaves the queue at once, and a running one's row
finishes computing and is freed when its batch ends. :class:`ClientChannel` makes each request's ASGI channel reachable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

from shared.schemas import ApiError

log = logging.getLogger("chapters.ch07_production.deadlines")

TIMEOUT_HEADER = "X-Request-Timeout-S"

T = TypeVar("T")


def effective_timeout(server_timeout_s: float, header_value: str | None) -> float:
    """The deadline, in seconds, of one request: ``server_timeout_s``, or the ``X-Request-Timeout-S`` header's if shorter
    (a larger one is capped); a header that is not a positive finite number of seconds raises 422."""
    # EXERCISE ch07.1 BEGIN "the deadline: the server's limit, or the client's if shorter"
    if header_value is None or header_value.strip() == "":
        return server_timeout_s
    try:
        asked = float(header_value)
    except ValueError:
        raise ApiError(422, "invalid_request", f"{TIMEOUT_HEADER}: {header_value!r} is not a number of seconds") from None
    if not asked > 0 or asked == float("inf"):  # also rejects NaN
        raise ApiError(422, "invalid_request", f"{TIMEOUT_HEADER}: must be a positive number of seconds, got {header_value!r}")
    return min(asked, server_timeout_s)


async def within_deadline(work: Awaitable[T], timeout_s: float) -> T:
    """Await ``work``; past ``timeout_s`` cancel it and raise 504 ``deadline_exceeded``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await work
    except TimeoutError:
        raise ApiError(504, "deadline_exceeded", f"the request did not finish within its deadline of {timeout_s:g} s") from None


# nginx's status for a client gone while its request was queued or running: only the metrics and the log read it
DISCONNECTED_STATUS = 499


Receive = Callable[[], Awaitable[dict[str, Any]]]  # an ASGI request's receive channel

# the receive channel of the HTTP request being handled (set by ClientChannel); None outside one: nobody to watch
client_receive: ContextVar[Receive | None] = ContextVar("client_receive", default=None)


class ClientChannel:
    """ASGI middleware: each HTTP request's ``receive`` in :data:`client_receive`, where the shell watches for the hang-up."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = client_receive.set(receive)
        try:
            await self.app(scope, receive, send)
        finally:
            client_receive.reset(token)


async def hang_up(receive: Receive) -> None:
    """Returns once the client has hung up: the ``http.disconnect`` the server sends when the connection closes."""
    while (await receive())["type"] != "http.disconnect":
        pass  # more of a body the handler has already read: not a hang-up


async def until_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """``work``'s result, unless the client behind ``receive`` hangs up first: then ``work`` is cancelled and 499
    ``client_disconnected`` raised. A channel that fails is logged and the work goes on."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(hang_up(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:
            log.error("watching the client failed; the request goes on", exc_info=watcher.exception())
            return await task
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ApiError(DISCONNECTED_STATUS, "client_disconnected", "the client disconnected while its request was running")
    finally:
        # however it ended (the deadline's cancel too), neither task outlives the request
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()


class StreamDeadline:
    """One deadline for a whole stream of events, on the event loop's clock, with one timer per stream (not one per
    token on the shared event loop's heap). :meth:`next` raises :class:`TimeoutError` once the deadline has passed."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.expired = False
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task | None = None  # the task inside next(), if one is

    async def next(self, events: AsyncIterator[T]) -> T:
        """``anext(events)`` within the deadline (StopAsyncIteration at the end, as anext)."""
        if self.expired:
            raise TimeoutError
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(self.deadline, self._expire)
        task = self._waiting = asyncio.current_task()
        try:
            return await anext(events)
        except asyncio.CancelledError:
            # the timer's cancel, and nobody else's: the deadline
            if self.expired and task is not None and task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            self._waiting = None

    def _expire(self) -> None:
        self.expired = True
        if self._waiting is not None:
            self._waiting.cancel()

    def cancel(self) -> None:
        """Stop the timer (the stream ended)."""
        if self._timer is not None:
            self._timer.cancel()
