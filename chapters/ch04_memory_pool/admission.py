"""Admission control: at arrival a request is queued, offloaded to the slow path or rejected (429); on the event loop only."""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from chapters.ch03_dynamic_batching.batcher import Clock, MonotonicClock
from shared.schemas import ApiError

log = logging.getLogger(__name__)


class Route(enum.Enum):
    BATCH = "batch"  # the batcher's queue, then a batch whose KV cache lives in the pool
    FALLBACK = "fallback"  # the slow path outside the pool


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting: int = 100  # requests that may wait in the batcher's queue
    pressure_threshold: float = 0.9  # pool use at or above this counts as pressure ...
    pressure_duration_s: float = 5.0  # ... once it has lasted this long
    fallback_slots: int = 1  # requests on the fallback path at once (0: never offload)

    def __post_init__(self) -> None:
        # Every request passes through the queue, if only for a moment: with no place in it, none is served.
        if self.max_waiting < 1 or self.fallback_slots < 0:
            raise ValueError("max_waiting >= 1 and fallback_slots >= 0 are required")
        if not 0.0 < self.pressure_threshold <= 1.0 or self.pressure_duration_s < 0:
            raise ValueError("pressure_threshold must be in (0, 1] and pressure_duration_s >= 0")


class AdmissionController:
    """Queue, offload or reject (429), decided per request at arrival. ``waiting()``: requests in the queue; ``pool_use()``:
    the pool's used share (0.0 to 1.0); both only read."""

    HOLD_TIME_SMOOTHING = 0.2  # weight of the newest sample in the recent time in the server

    def __init__(
        self, config: AdmissionConfig, waiting: Callable[[], int], pool_use: Callable[[], float], clock: Clock | None = None
    ) -> None:
        self.config = config
        self._waiting = waiting
        self._pool_use = pool_use
        self._clock = clock or MonotonicClock()
        self._above_since: float | None = None  # when pool use was last seen to reach the threshold
        self._recent_hold_s: float | None = None
        self._in_flight = 0  # admitted to the batch route and not finished
        self.fallback_in_flight = 0
        self.admitted = 0
        self.rejected = 0
        self.fallback_served = 0

    def admit(self) -> Route:
        """The route of a new request, after sampling the pool's use; raises ApiError(429) when it may not even wait.
        BATCH (counted in ``admitted``) while fewer than ``max_waiting`` wait; with the queue full, FALLBACK (a slot taken,
        counted in ``fallback_served``) when :meth:`under_pressure` and a slot is free; else counted in ``rejected``.
        Report a BATCH request with :meth:`finished`, a FALLBACK one with :meth:`fallback_done`, whatever happens to it."""
        # EXERCISE ch04.4 BEGIN "admission: queue while there is room, offload under sustained pressure, else 429"
        self._observe_pressure()
        if self._waiting() < self.config.max_waiting:
            self._in_flight += 1
            self.admitted += 1
            return Route.BATCH
        # The queue is full. Under sustained pressure a slow answer beats a refusal; otherwise refuse.
        if self.under_pressure() and self.fallback_in_flight < self.config.fallback_slots:
            self.fallback_in_flight += 1
            self.fallback_served += 1
            log.info("pool under pressure (%.0f%% used): request served on the fallback path", 100 * self._pool_use())
            return Route.FALLBACK
        self.rejected += 1
        raise self._too_many_requests()

    def finished(self, seconds_in_server: float) -> None:
        """A request of the batch route is done (answered, failed or abandoned)."""
        self._in_flight -= 1
        if self._recent_hold_s is None:
            self._recent_hold_s = seconds_in_server
        else:
            weight = self.HOLD_TIME_SMOOTHING
            self._recent_hold_s = (1 - weight) * self._recent_hold_s + weight * seconds_in_server

    def fallback_done(self) -> None:
        self.fallback_in_flight -= 1

    def _observe_pressure(self) -> None:
        """Pool use is sampled at every arrival: under load that is often, and idle there is nothing to decide."""
        above = self._pool_use() >= self.config.pressure_threshold
        if above and self._above_since is None:
            self._above_since = self._clock.now()
        elif not above and self._above_since is not None:
            if self.under_pressure():
                log.info("pool pressure is over (%.0f%% used)", 100 * self._pool_use())
            self._above_since = None

    def under_pressure(self) -> bool:
        """Pool use has been at or above the threshold for at least the configured duration."""
        return self._above_since is not None and self._clock.now() - self._above_since >= self.config.pressure_duration_s

    def retry_after_s(self) -> int:
        """Seconds for ``Retry-After``: recent time in server x (waiting + 1) / in flight, rounded up, >= 1 (1 at first)."""
        if self._recent_hold_s is None:
            return 1
        estimate = self._recent_hold_s * (self._waiting() + 1) / max(1, self._in_flight)
        return max(1, math.ceil(estimate))

    def _too_many_requests(self) -> ApiError:
        retry_after = self.retry_after_s()
        return ApiError(
            429, "overloaded",
            f"the queue is full ({self._waiting()} requests waiting); retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )

    def stats(self) -> dict:
        above_for = self._clock.now() - self._above_since if self._above_since is not None else 0.0
        return {
            "in_flight": self._in_flight,
            "waiting": self._waiting(),
            "max_waiting": self.config.max_waiting,
            "admitted_total": self.admitted,
            "rejected_total": self.rejected,
            "under_pressure": self.under_pressure(),
            "above_threshold_for_s": round(above_for, 3),
            "fallback_in_flight": self.fallback_in_flight,
            "fallback_served_total": self.fallback_served,
            "recent_time_in_server_s": round(self._recent_hold_s, 4) if self._recent_hold_s is not None else None,
            "retry_after_s": self.retry_after_s(),
        }
