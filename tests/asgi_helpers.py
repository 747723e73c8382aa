"""Running a chapter's app in the test's own event loop: its lifespan entered by hand, an httpx client
over the ASGI transport, and waiting for a state (never for time)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import httpx


async def until(condition: Callable[[], bool], limit_s: float = 60.0, spin_turns: int = 1_000) -> None:
    """Yield to the event loop until ``condition`` holds (a state change, not a timer); fail after ``limit_s``.

    The first ``spin_turns`` checks only yield to the loop (states the loop itself reaches). After that
    each check also lets go of the interpreter for a millisecond: the state may be another thread's to
    reach (an inference thread between two steps), and a loop spinning on ``sleep(0)`` would hold the
    GIL that thread needs. The bound is a deadline, not a count of turns, so a slow or busy machine
    does not turn a wait into a failure.
    """
    deadline = time.monotonic() + limit_s
    turns = 0
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never reached the expected state (waited {limit_s:g} s)")
        turns += 1
        await asyncio.sleep(0 if turns < spin_turns else 0.001)


async def serving(app, scenario: Callable[[httpx.AsyncClient], Awaitable[None]], base_url: str = "http://test") -> None:
    """Run ``scenario(client)`` against ``app`` between its start-up and its shutdown."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url, timeout=60) as client:
            await scenario(client)


async def serving_gated(app, gate: threading.Event, scenario: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    """:func:`serving`, with ``gate`` opened however the scenario ends: a failed assertion must not leave
    a model step waiting on the gate, since the app's shutdown waits for that step."""
    async def guarded(client: httpx.AsyncClient) -> None:
        before = asyncio.all_tasks()
        try:
            await scenario(client)
        finally:
            gate.set()
            # What the scenario started and left running (a request in flight, a drain) ends now that the
            # gate is open; awaited here, while the app still runs, so a failed assertion is reported at
            # once instead of leaving those tasks to a cancellation the app shields accepted work from.
            left = asyncio.all_tasks() - before - {asyncio.current_task()}
            if left:
                await asyncio.wait(left, timeout=30)

    await serving(app, guarded)
