"""Admission control: what happens to a request when the pool is full. The article's three answers, combined.

1. **Queue.** A request reserves pool blocks before it may join the batcher. If they are not free, it
   waits, first in first out, in a bounded queue (the article suggests 100).
2. **Reject.** When that queue is full too, the request gets 429 with a ``Retry-After`` header: the
   client learns to come back instead of piling up timeouts.
3. **Offload.** When pool use has stayed at or above a threshold (90 %) for a while, the pool is not
   having a busy moment, it is overloaded: a request that finds the queue full is served on a slower
   path outside the pool (the CPU fallback), up to a few at a time, instead of being refused. It
   replaces the refusal, not the wait: while the queue has room, waiting for the fast path is
   usually quicker than the slow path.

Everything here runs on the event loop only (``admit`` and ``release`` are called from request
handlers), so the ledger needs no lock: between two ``await`` points nothing else touches it.

The ledger counts **reservations**, not the pool's live ranges. A request reserves the blocks for the
longest sequence any request may have (the article's "peak per request"), because a padded batch of
``B`` rows spans ``B x (longest prompt + most new tokens)`` slots, which can exceed the sum of the
rows' own needs but never ``B`` worst cases. So when a batch starts, its contiguous range is covered
by its requests' reservations and allocating it on the inference thread cannot fail.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections import deque
from dataclasses import dataclass

from chapters.ch03_dynamic_batching.batcher import Clock, MonotonicClock
from shared.schemas import ApiError

log = logging.getLogger(__name__)


class Route(enum.Enum):
    POOL = "pool"  # the batcher, KV cache in the pool
    FALLBACK = "fallback"  # the slow path outside the pool


@dataclass(eq=False)
class Ticket:
    """An admitted request: where it runs and what it holds. Hand it back with :meth:`AdmissionController.release`."""

    route: Route
    blocks: int
    admitted_at: float
    released: bool = False


@dataclass(frozen=True)
class AdmissionConfig:
    capacity_blocks: int
    max_waiting: int = 100  # the article's queue bound
    pressure_threshold: float = 0.9  # pool use at or above this counts as pressure ...
    pressure_duration_s: float = 5.0  # ... once it has lasted this long
    fallback_slots: int = 1  # requests on the fallback path at once (0: never offload)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1 or self.max_waiting < 0 or self.fallback_slots < 0:
            raise ValueError("capacity_blocks >= 1, max_waiting >= 0 and fallback_slots >= 0 are required")
        if not 0.0 < self.pressure_threshold <= 1.0 or self.pressure_duration_s < 0:
            raise ValueError("pressure_threshold must be in (0, 1] and pressure_duration_s >= 0")


@dataclass(eq=False)
class _Waiter:
    blocks: int
    granted: asyncio.Future[Ticket]


class AdmissionController:
    """Reserve pool blocks per request: admit, queue, offload or reject (429)."""

    HOLD_TIME_SMOOTHING = 0.2  # weight of the newest sample in the recent hold time

    def __init__(self, config: AdmissionConfig, clock: Clock | None = None) -> None:
        self.config = config
        self._clock = clock or MonotonicClock()
        self._reserved_blocks = 0
        self._admitted = 0
        self._waiting: deque[_Waiter] = deque()
        self._fallback_in_flight = 0
        self._above_since: float | None = None  # when pool use last rose to the threshold
        self._recent_hold_s: float | None = None
        self.rejected = 0
        self.fallback_served = 0
        self.waited = 0

    # ------------------------------------------------------------------ admitting

    async def admit(self, blocks: int) -> Ticket:
        """A ticket once the request may run; raise ApiError(429) when it may not even wait.

        ``blocks`` larger than the whole pool can never fit: that is a configuration error (the
        server sizes reservations from its own limits), so it raises ValueError rather than queueing.
        """
        if blocks > self.config.capacity_blocks:
            raise ValueError(f"a reservation of {blocks} blocks can never fit a pool of {self.config.capacity_blocks}")
        if not self._waiting and self._fits(blocks):
            return self._reserve(blocks)
        if len(self._waiting) < self.config.max_waiting:
            return await self._wait_for_blocks(blocks)
        # The queue is full. Under sustained pressure a slow answer beats a refusal; otherwise refuse.
        if self.under_pressure() and self._fallback_in_flight < self.config.fallback_slots:
            return self._start_fallback()
        self.rejected += 1
        raise self._too_many_requests()

    async def _wait_for_blocks(self, blocks: int) -> Ticket:
        waiter = _Waiter(blocks, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self.waited += 1
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            # The client left while waiting. If the grant raced the cancellation, give it back.
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.granted.done() and not waiter.granted.cancelled():
                self.release(waiter.granted.result())
            raise

    def _fits(self, blocks: int) -> bool:
        return self._reserved_blocks + blocks <= self.config.capacity_blocks

    def _reserve(self, blocks: int) -> Ticket:
        self._set_reserved(self._reserved_blocks + blocks)
        self._admitted += 1
        return Ticket(Route.POOL, blocks, self._clock.now())

    def _start_fallback(self) -> Ticket:
        self._fallback_in_flight += 1
        self.fallback_served += 1
        log.info("pool under pressure (%.0f%% used): request served on the fallback path", 100 * self.pool_use)
        return Ticket(Route.FALLBACK, 0, self._clock.now())

    # ------------------------------------------------------------------ releasing

    def release(self, ticket: Ticket) -> None:
        """Give back what ``ticket`` holds and let waiting requests in, oldest first. Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.route is Route.FALLBACK:
            self._fallback_in_flight -= 1
            return
        self._admitted -= 1
        self._set_reserved(self._reserved_blocks - ticket.blocks)
        self._remember_hold_time(self._clock.now() - ticket.admitted_at)
        self._grant_waiters()

    def _grant_waiters(self) -> None:
        # Strict FIFO: a small request never overtakes a large head, so nobody starves.
        while self._waiting and self._fits(self._waiting[0].blocks):
            waiter = self._waiting.popleft()
            if not waiter.granted.done():  # skip a waiter whose handler was cancelled
                waiter.granted.set_result(self._reserve(waiter.blocks))

    def _remember_hold_time(self, seconds: float) -> None:
        if self._recent_hold_s is None:
            self._recent_hold_s = seconds
        else:
            weight = self.HOLD_TIME_SMOOTHING
            self._recent_hold_s = (1 - weight) * self._recent_hold_s + weight * seconds

    # ------------------------------------------------------------------ pressure

    def _set_reserved(self, blocks: int) -> None:
        self._reserved_blocks = blocks
        above = self.pool_use >= self.config.pressure_threshold
        if above and self._above_since is None:
            self._above_since = self._clock.now()
        elif not above and self._above_since is not None:
            if self.under_pressure():
                log.info("pool pressure is over (%.0f%% used)", 100 * self.pool_use)
            self._above_since = None

    @property
    def pool_use(self) -> float:
        """Reserved share of the pool, 0.0 to 1.0."""
        return self._reserved_blocks / self.config.capacity_blocks

    def under_pressure(self) -> bool:
        """Pool use has been at or above the threshold for at least the configured duration."""
        return self._above_since is not None and self._clock.now() - self._above_since >= self.config.pressure_duration_s

    # ------------------------------------------------------------------ 429

    def retry_after_s(self) -> int:
        """Whole seconds after which a retry has a fair chance, for the ``Retry-After`` header.

        Estimate: the admitted requests leave at about ``admitted / recent hold time`` per second,
        and everyone waiting is ahead of the retry. So wait ``recent hold x (waiting + 1) / admitted``,
        rounded up, at least 1 s (before any request finished, 1 s).
        """
        if self._recent_hold_s is None:
            return 1
        estimate = self._recent_hold_s * (len(self._waiting) + 1) / max(1, self._admitted)
        return max(1, math.ceil(estimate))

    def _too_many_requests(self) -> ApiError:
        retry_after = self.retry_after_s()
        return ApiError(
            429, "overloaded",
            f"the KV-cache pool is full and {len(self._waiting)} requests are already waiting; retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict:
        above_for = self._clock.now() - self._above_since if self._above_since is not None else 0.0
        return {
            "capacity_blocks": self.config.capacity_blocks,
            "reserved_blocks": self._reserved_blocks,
            "reserved_use": round(self.pool_use, 4),
            "admitted": self._admitted,
            "waiting": len(self._waiting),
            "max_waiting": self.config.max_waiting,
            "waited_total": self.waited,
            "rejected_total": self.rejected,
            "under_pressure": self.under_pressure(),
            "above_threshold_for_s": round(above_for, 3),
            "fallback_in_flight": self._fallback_in_flight,
            "fallback_served_total": self.fallback_served,
            "recent_hold_s": round(self._recent_hold_s, 4) if self._recent_hold_s is not None else None,
            "retry_after_s": self.retry_after_s(),
        }
