"""The adaptive window: the batcher waits its tuned window only when another request is expected within it, else a floor."""

from __future__ import annotations

from chapters.ch02_fastapi_async.api import DisconnectCheck
from chapters.ch03_dynamic_batching.batcher import DynamicBatcher


class ArrivalRate:
    """The gaps between arrivals, in seconds: an exponentially weighted mean, and the latest one."""

    def __init__(self, smoothing: float = 0.2) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.mean_gap_s: float | None = None
        self.last_gap_s: float | None = None
        self.last_arrival: float | None = None

    def observe(self, now: float) -> None:
        """Record an arrival at ``now``: from the second one on, update the mean gap and the latest gap."""
        # EXERCISE ch06.2 BEGIN "the arrival rate: a smoothed gap and the latest one"
        if self.last_arrival is not None:
            gap = max(0.0, now - self.last_arrival)
            self.mean_gap_s = gap if self.mean_gap_s is None else self.mean_gap_s + self.smoothing * (gap - self.mean_gap_s)
            self.last_gap_s = gap
        self.last_arrival = now

    def expected_within(self, window_s: float, now: float) -> float:
        """Arrivals expected in the next ``window_s`` seconds (0 until two arrivals were seen), at one per gap: the shorter of the
        mean and the latest gap, but never shorter than the silence since the last arrival (a burst long past is forgotten)."""
        # EXERCISE ch06.2 BEGIN "the arrival rate: a smoothed gap and the latest one"
        if self.mean_gap_s is None or self.last_gap_s is None or self.last_arrival is None:
            return 0.0
        gap = max(min(self.mean_gap_s, self.last_gap_s), now - self.last_arrival, 1e-9)
        return window_s / gap


class AdaptiveBatcher(DynamicBatcher):
    """Chapter 3's batcher with :meth:`window_s` chosen per batch from the arrival rate."""

    def __init__(self, *args, min_window_s: float = 0.001, smoothing: float = 0.2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if min_window_s < 0:
            raise ValueError(f"min_window_s must be >= 0, got {min_window_s}")
        self.min_window_s = min(min_window_s, self.config.window_s)
        self.arrivals = ArrivalRate(smoothing)

    def enqueue(self, request, is_disconnected: DisconnectCheck | None = None):
        future = super().enqueue(request, is_disconnected)
        self.arrivals.observe(self._clock.now())
        return future

    def window_s(self) -> float:
        """The full ``config.window_s`` if at least one more arrival is expected within it, else ``min_window_s``."""
        # EXERCISE ch06.1 BEGIN "the adaptive window rule"
        expected = self.arrivals.expected_within(self.config.window_s, self._clock.now())
        return self.config.window_s if expected >= 1.0 else self.min_window_s

    def describe(self) -> dict:
        gap = self.arrivals.mean_gap_s
        return {
            **super().describe(),
            "min_window_ms": self.min_window_s * 1e3,
            "current_window_ms": round(self.window_s() * 1e3, 3),
            "mean_arrival_gap_ms": None if gap is None else round(gap * 1e3, 3),
        }
