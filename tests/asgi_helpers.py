"""Running a chapter's app in the test's own event loop: its lifespan entered by hand, an httpx client
over the ASGI transport, and waiting for a state (never for time)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx


async def until(condition: Callable[[], bool], max_turns: int = 200_000) -> None:
    """Yield to the event loop until ``condition`` holds (a state change, not a timer)."""
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the server never reached the expected state")


async def serving(app, scenario: Callable[[httpx.AsyncClient], Awaitable[None]], base_url: str = "http://test") -> None:
    """Run ``scenario(client)`` against ``app`` between its start-up and its shutdown."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, timeout=60) as client:
            await scenario(client)
