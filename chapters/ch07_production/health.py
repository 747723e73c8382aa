"""Health that cannot lie: liveness is "the event loop answers", readiness is "a real forward pass works now".

A readiness check that only returns ``{"status": "ok"}`` stays green while the device is wedged, the
weights are corrupt or every forward pass takes ten seconds. :class:`ReadinessProbe` runs a tiny
real generation (a prefill and one decode step on a fixed prompt) every ``interval_s`` in its own
thread, bounded by ``timeout_s``; readiness is the last probe's verdict. A probe that raises, or
takes longer than its timeout, makes the instance not ready until a later probe passes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from chapters.ch03_dynamic_batching.batched_generation import generate_batch
from shared.model import StepModel

log = logging.getLogger("chapters.ch07_production.health")

PROBE_PROMPT = [1, 2, 3, 4]  # a fixed prompt: any model accepts ids below 5


def forward_probe(model: StepModel, pad_id: int) -> Callable[[], None]:
    """A blocking function that runs a prefill and a decode step through ``model``, with its own small cache."""

    def probe() -> None:
        (row,) = generate_batch(model, [PROBE_PROMPT], [2], pad_id)
        if len(row.output_ids) != 2:
            raise RuntimeError(f"the probe generated {len(row.output_ids)} tokens instead of 2")

    return probe


@dataclass
class ProbeResult:
    ok: bool
    reason: str
    seconds: float
    at: float  # time.monotonic() when it finished


class ReadinessProbe:
    """Runs ``probe`` periodically off the event loop; :attr:`last` is the latest verdict (None: none yet)."""

    def __init__(self, probe: Callable[[], None], interval_s: float, timeout_s: float) -> None:
        self.probe, self.interval_s, self.timeout_s = probe, interval_s, timeout_s
        self.last: ProbeResult | None = None
        self.passed = asyncio.Event()  # set once any probe has passed (start-up is over)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="readiness-probe")
        self._pending = None  # a probe still running in the thread (timed out): never start a second one
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="readiness-probe")

    async def run_once(self) -> ProbeResult:
        """One probe, recorded in :attr:`last`."""
        started = time.monotonic()
        if self._pending is not None and not self._pending.done():
            result = ProbeResult(False, "the previous probe is still running", 0.0, started)
        else:
            self._pending = asyncio.get_running_loop().run_in_executor(self._executor, self.probe)
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
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
