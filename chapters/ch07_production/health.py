"""Health that cannot lie: liveness is "the event loop answers", readiness is "a real request is answered now".

:class:`ReadinessProbe` sends one tiny real request through the serving backend every ``interval_s``, bounded by
``timeout_s``; readiness is the last probe's verdict. A probe refused with 429 passes: the backend answered, busy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from chapters.ch02_fastapi_async.api import Backend
from shared.schemas import ApiError, ValidRequest

log = logging.getLogger("chapters.ch07_production.health")

PROBE_PROMPT = [1, 2, 3, 4]  # a fixed prompt: any model accepts ids below 5
PROBE_NEW_TOKENS = 2


def request_probe(serving: Callable[[], Backend]) -> Callable[[], Awaitable[None]]:
    """A probe that sends one real request through the backend ``serving()`` returns (the newest version)."""

    async def still_here() -> bool:
        return False

    async def probe() -> None:
        try:
            result = await serving().generate(ValidRequest(list(PROBE_PROMPT), PROBE_NEW_TOKENS), still_here)
        except ApiError as exc:
            if exc.status == 429:
                return  # answered: busy, not broken
            raise
        if len(result.output_ids) != PROBE_NEW_TOKENS:
            raise RuntimeError(f"the probe generated {len(result.output_ids)} tokens instead of {PROBE_NEW_TOKENS}")

    return probe


@dataclass
class ProbeResult:
    ok: bool
    reason: str
    seconds: float
    at: float  # time.monotonic() when it finished


class ReadinessProbe:
    """Runs ``probe`` (a coroutine function) periodically; :attr:`last` is the latest verdict (None: none yet)."""

    def __init__(self, probe: Callable[[], Awaitable[None]], interval_s: float, timeout_s: float) -> None:
        self.probe, self.interval_s, self.timeout_s = probe, interval_s, timeout_s
        self.last: ProbeResult | None = None
        self.passed = asyncio.Event()  # set once any probe has passed (start-up is over)
        self._pending: asyncio.Task | None = None  # a probe still running (timed out): never start a second one
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="readiness-probe")

    async def run_once(self) -> ProbeResult:
        """One probe, recorded in :attr:`last`."""
        started = time.monotonic()
        if self._pending is not None and not self._pending.done():
            result = ProbeResult(False, "the previous probe is still running", 0.0, started)
        else:
            self._pending = asyncio.create_task(self.probe(), name="readiness-probe-request")
            try:
                await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
                result = ProbeResult(True, "ok", time.monotonic() - started, time.monotonic())
            except TimeoutError:
                result = ProbeResult(False, f"the probe took longer than {self.timeout_s:g} s", time.monotonic() - started, time.monotonic())
            except Exception as exc:
                result = ProbeResult(False, f"the probe failed: {type(exc).__name__}: {exc}", time.monotonic() - started, time.monotonic())
        if not result.ok and (self.last is None or self.last.ok):
            log.warning("not ready: %s", result.reason)
        elif result.ok and self.last is not None and not self.last.ok:
            log.info("ready again")
        self.last = result
        if result.ok:
            self.passed.set()
        return result

    async def _run_forever(self) -> None:
        while True:
            await self.run_once()
            await asyncio.sleep(self.interval_s)  # a period, not a wait for a state

    async def close(self) -> None:
        for task in (self._task, self._pending):
            if task is not None and not task.done():
                task.cancel()
