"""Chapter 4's admission control, as a unit: queue while there is room, 429 with Retry-After, offload under sustained pressure.

The controller reads the queue's length and the pool's use through two callables; the test sets
them, and a hand-driven clock replaces time, so "pressure for N seconds" is a number we set, never a sleep.
"""

from __future__ import annotations


import pytest

from chapters.ch04_memory_pool.admission import AdmissionConfig, AdmissionController, Route
from shared.schemas import ApiError


class HandClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def wait(self, event, timeout: float | None) -> None:  # the Clock protocol; unused here
        await event.wait()


class World:
    """What the controller reads: the queue's length and the pool's used share."""

    def __init__(self) -> None:
        self.waiting = 0
        self.pool_use = 0.0


def controller(**overrides) -> tuple[AdmissionController, World, HandClock]:
    clock, world = HandClock(), World()
    config = AdmissionConfig(**{"max_waiting": 2, "fallback_slots": 0, **overrides})
    return AdmissionController(config, lambda: world.waiting, lambda: world.pool_use, clock), world, clock


def test_requests_queue_while_there_is_room_then_get_429_with_retry_after() -> None:
    admission, world, clock = controller(max_waiting=2)
    assert admission.admit() is Route.BATCH
    world.waiting = 1
    assert admission.admit() is Route.BATCH
    world.waiting = 2  # the queue is full
    with pytest.raises(ApiError) as rejected:
        admission.admit()
    assert rejected.value.status == 429 and rejected.value.type == "overloaded"
    assert int(rejected.value.headers["Retry-After"]) >= 1
    stats = admission.stats()
    assert (stats["admitted_total"], stats["rejected_total"], stats["in_flight"]) == (2, 1, 2)
    admission.finished(0.5)
    admission.finished(0.5)
    assert admission.stats()["in_flight"] == 0


def test_retry_after_follows_the_recent_time_in_the_server() -> None:
    admission, world, _clock = controller(max_waiting=4)
    assert admission.retry_after_s() == 1  # nothing finished yet: no estimate, the minimum
    for _ in range(2):
        admission.admit()
    admission.finished(6.0)  # one request spent 6 s in the server; one is still in flight
    world.waiting = 3
    # 6 s x (3 waiting + 1) / 1 in flight = 24 s
    assert admission.retry_after_s() == 24


def test_sustained_pressure_sends_what_the_full_queue_would_refuse_to_the_fallback() -> None:
    admission, world, clock = controller(max_waiting=1, fallback_slots=1, pressure_threshold=0.9, pressure_duration_s=5.0)
    world.pool_use, world.waiting = 0.95, 1
    with pytest.raises(ApiError):  # pressure starts now: not sustained yet
        admission.admit()
    clock.t += 5.0
    assert admission.admit() is Route.FALLBACK  # five seconds above the threshold: offload
    with pytest.raises(ApiError):  # the only fallback slot is taken
        admission.admit()
    admission.fallback_done()
    assert admission.admit() is Route.FALLBACK
    admission.fallback_done()
    world.pool_use = 0.5  # pressure is over: refusing again
    with pytest.raises(ApiError):
        admission.admit()
    assert not admission.under_pressure()
    assert admission.stats()["fallback_served_total"] == 2


def test_a_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError):
        AdmissionConfig(max_waiting=0)
    with pytest.raises(ValueError):
        AdmissionConfig(pressure_threshold=0.0)
