"""Chapter 4's admission control, as a unit: queue, reject with Retry-After, offload under sustained pressure.

A hand-driven clock replaces time, so "pressure for N seconds" is a number we set, never a sleep.
"""

from __future__ import annotations

import asyncio

import pytest

from chapters.ch04_memory_pool.admission import (
    AdmissionConfig,
    AdmissionController,
    Route,
)
from shared.schemas import ApiError


class HandClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:  # the Clock protocol; unused here
        await event.wait()


def controller(capacity: int = 4, **overrides) -> tuple[AdmissionController, HandClock]:
    clock = HandClock()
    config = AdmissionConfig(capacity_blocks=capacity, **{"max_waiting": 2, "fallback_slots": 0, **overrides})
    return AdmissionController(config, clock), clock


async def _settle() -> None:
    """Let every task that is ready run until it blocks again (no timed waiting)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_wait_in_order_then_get_429_with_retry_after() -> None:
    async def scenario() -> None:
        admission, clock = controller(capacity=4, max_waiting=2)
        first, second = await admission.admit(2), await admission.admit(2)
        assert admission.pool_use == 1.0
        waiting = [asyncio.create_task(admission.admit(2)) for _ in range(2)]
        await _settle()
        assert admission.stats()["waiting"] == 2 and not any(t.done() for t in waiting)
        with pytest.raises(ApiError) as rejected:
            await admission.admit(2)
        assert rejected.value.status == 429
        assert int(rejected.value.headers["Retry-After"]) >= 1
        # A finished request lets exactly the oldest waiter in.
        clock.t += 3.0
        admission.release(first)
        await _settle()
        assert waiting[0].done() and not waiting[1].done()
        assert (await waiting[0]).route is Route.POOL
        admission.release(second)
        await _settle()
        assert waiting[1].done()
        for task in waiting:
            admission.release(task.result())
        stats = admission.stats()
        assert stats["reserved_blocks"] == 0 and stats["admitted"] == 0 and stats["rejected_total"] == 1

    asyncio.run(scenario())


def test_retry_after_follows_the_recent_hold_time() -> None:
    async def scenario() -> None:
        admission, clock = controller(capacity=2, max_waiting=0)
        ticket = await admission.admit(2)
        clock.t += 7.5
        admission.release(ticket)
        ticket = await admission.admit(2)
        # One admitted request, nobody waiting: a slot frees after about one hold time.
        assert admission.retry_after_s() == 8
        with pytest.raises(ApiError) as rejected:
            await admission.admit(2)
        assert rejected.value.headers["Retry-After"] == "8"
        admission.release(ticket)

    asyncio.run(scenario())


def test_sustained_pressure_sends_what_the_full_queue_would_refuse_to_the_fallback() -> None:
    async def scenario() -> None:
        admission, clock = controller(capacity=10, max_waiting=1, pressure_threshold=0.9, pressure_duration_s=4.0, fallback_slots=1)
        held = await admission.admit(9)  # 90 %: pressure starts now
        queued = asyncio.create_task(admission.admit(2))  # doesn't fit: waits, pressure or not
        await _settle()
        assert not queued.done()
        clock.t += 3.9
        with pytest.raises(ApiError):  # queue full, pressure not long enough yet: refused
            await admission.admit(2)
        clock.t += 0.1
        assert admission.under_pressure()
        offloaded = await admission.admit(2)  # queue full, sustained pressure: the slow path
        assert offloaded.route is Route.FALLBACK and offloaded.blocks == 0
        with pytest.raises(ApiError) as refused:  # the one fallback slot is taken: refused again
            await admission.admit(2)
        assert refused.value.status == 429
        assert admission.stats()["fallback_in_flight"] == 1
        admission.release(offloaded)
        admission.release(offloaded)  # idempotent
        admission.release(held)  # pressure ends; the waiter fits
        await _settle()
        assert not admission.under_pressure() and admission.stats()["fallback_served_total"] == 1
        admission.release(await queued)
        assert admission.stats()["reserved_blocks"] == 0 and admission.stats()["rejected_total"] == 2

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    async def scenario() -> None:
        admission, _clock = controller(capacity=2, max_waiting=2)
        held = await admission.admit(2)
        gone = asyncio.create_task(admission.admit(2))
        stays = asyncio.create_task(admission.admit(2))
        await _settle()
        gone.cancel()
        await _settle()
        assert admission.stats()["waiting"] == 1
        admission.release(held)
        await _settle()
        admission.release(await stays)
        assert admission.stats()["reserved_blocks"] == 0 and admission.stats()["admitted"] == 0

    asyncio.run(scenario())


def test_a_reservation_larger_than_the_pool_is_a_configuration_error() -> None:
    admission, _clock = controller(capacity=4)
    with pytest.raises(ValueError):
        asyncio.run(admission.admit(5))
