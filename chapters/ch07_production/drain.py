"""Graceful drain: on SIGTERM stop being ready, refuse new work with 503, finish what was accepted, then exit.

:class:`DrainingServer` takes the signal from uvicorn (which would close the listening socket at once): the
:class:`DrainController` turns ``/readyz`` and new requests to 503 with ``Retry-After``, waits for the requests in flight
or the drain timeout, and only then lets uvicorn exit. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn

from chapters.ch03_dynamic_batching.live_view import LiveView, LiveViewServer
from shared.schemas import ApiError

log = logging.getLogger("chapters.ch07_production.drain")


@dataclass(frozen=True)
class DrainReport:
    waited_s: float
    cut_off: int  # requests still in flight when the timeout ran out


class DrainController:
    """Counts the requests in flight and runs the drain sequence."""

    def __init__(self, timeout_s: float, retry_after_s: int = 1) -> None:
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """A request starts: refused with 503 + Retry-After while draining, else counted."""
        if self.draining:
            raise ApiError(503, "draining", "the server is shutting down; retry on another instance",
                           {"Retry-After": str(self.retry_after_s)})
        self.in_flight += 1
        self._idle.clear()

    def exit(self) -> None:
        """A request counted by :meth:`enter` has been answered (whatever the outcome)."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self) -> DrainReport:
        """Stop taking requests, wait until none is in flight or ``timeout_s`` passed, log the outcome; returns how long it
        waited and how many requests were still in flight (0 when everything accepted was answered)."""
        # EXERCISE ch07.2 BEGIN "the drain sequence: refuse new work, wait for in-flight to reach zero, bounded"
        started = time.monotonic()
        self.draining = True
        log.info("draining: %d requests in flight, waiting up to %.1f s", self.in_flight, self.timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_s)
        except TimeoutError:
            pass
        report = DrainReport(waited_s=time.monotonic() - started, cut_off=self.in_flight)
        if report.cut_off:
            log.warning("drain timeout after %.1f s: cutting off %d requests still in flight", report.waited_s, report.cut_off)
        else:
            log.info("drained in %.2f s: every accepted request was answered", report.waited_s)
        return report


class DrainingServer(LiveViewServer):
    """A uvicorn server (chapter 3's, with its live page) whose first SIGTERM/SIGINT drains through ``controller`` before exiting."""

    def __init__(self, config: uvicorn.Config, controller: DrainController, live_view: LiveView | None = None) -> None:
        super().__init__(config, live_view)
        self.controller = controller
        self.drain_report: DrainReport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            log.warning("second signal %s during the drain: exiting now", signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            return
        # Python runs signal handlers in the main thread, between the loop's callbacks: schedule, don't block.
        self._drain_task = self._loop.create_task(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        log.info("%s received", signal.Signals(sig).name)
        try:
            self.drain_report = await self.controller.drain()
        finally:
            self.should_exit = True
