"""Fakes for batcher tests (chapters 3 and 6): a clock moved by hand and a model that records batches."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

SAFETY_TIMEOUT_S = 30  # only so a broken batcher fails a test instead of hanging it


class FakeClock:
    """Time stands still until ``advance``; the batcher's waits are recorded so tests can see them."""

    def __init__(self) -> None:
        self.time = 0.0
        self.deadline: float | None = None  # when the batcher's current wait would time out
        self._timers: list[tuple[float, asyncio.Future[None]]] = []
        self._event: asyncio.Event | None = None
        self._changed = asyncio.Condition()

    def now(self) -> float:
        return self.time

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.create_future()
        if timeout is not None:
            self._timers.append((self.time + timeout, timer))
        event_waiter = asyncio.ensure_future(event.wait())
        self._event, self.deadline = event, None if timeout is None else self.time + timeout
        await self._notify()
        try:
            await asyncio.wait({event_waiter, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            event_waiter.cancel()
            self._timers = [(t, f) for t, f in self._timers if f is not timer]
            self._event, self.deadline = None, None
            await self._notify()

    async def advance(self, seconds: float) -> None:
        self.time += seconds
        for deadline, timer in self._timers:
            if deadline <= self.time and not timer.done():
                timer.set_result(None)

    async def until_parked(self) -> None:
        """Return once the batcher is blocked in ``wait`` and nothing (arrival, due timer) will wake it."""
        async with self._changed:
            await self._changed.wait_for(self._parked)

    def _parked(self) -> bool:
        return self._event is not None and not self._event.is_set() and not any(
            d <= self.time for d, _ in self._timers
        )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


class FakeModel:
    """A batch runner that records every batch, can be held at a gate, and fails batches holding ``poison``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, poison: object = None) -> None:
        self.loop = loop
        self.poison = poison
        self.batches: list[list] = []
        self.started: asyncio.Queue[list] = asyncio.Queue()
        self.gate = threading.Event()
        self.gate.set()  # open: batches run straight through
        self._running = 0
        self.max_running = 0
        self._lock = threading.Lock()

    def __call__(self, requests: list) -> list:
        with self._lock:
            self._running += 1
            self.max_running = max(self.max_running, self._running)
        try:
            self.batches.append(list(requests))
            self.loop.call_soon_threadsafe(self.started.put_nowait, list(requests))
            self.gate.wait(SAFETY_TIMEOUT_S)
            if self.poison in requests:
                raise RuntimeError("the fake model broke")
            return [f"out:{r}" for r in requests]
        finally:
            with self._lock:
                self._running -= 1


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), SAFETY_TIMEOUT_S))
