"""Graded tests of chapter 4's exercises: first fit (ch04.1), coalescing free (ch04.2), the sizing rule (ch04.3),
admission's queue-or-429 rule (ch04.4).

The allocator is pure bookkeeping, so the oracle is a plain set of free block numbers: after any
sequence of allocations and frees, the allocator's free ranges must be exactly the maximal runs of
that set, in address order. Admission reads the queue's length and the pool's use from a world the
test sets, and time from a clock moved by hand.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chapters.ch04_memory_pool.admission import (
    AdmissionConfig,
    AdmissionController,
    Route,
)
from chapters.ch04_memory_pool.memory_pool import (
    BlockAllocator,
    PoolExhausted,
    pool_tokens_by_rule,
)
from shared.schemas import ApiError


def runs(free_blocks: set[int]) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of consecutive block numbers, in order."""
    result: list[tuple[int, int]] = []
    for block in sorted(free_blocks):
        if result and result[-1][0] + result[-1][1] == block:
            result[-1] = (result[-1][0], result[-1][1] + 1)
        else:
            result.append((block, 1))
    return result


# ----------------------------------------------------------------------------- ch04.1: first fit


@pytest.mark.exercise("ch04.1")
def test_allocations_are_cut_from_the_front_one_after_the_other() -> None:
    allocator = BlockAllocator(10)
    first = allocator.allocate(3)
    second = allocator.try_allocate(4)
    assert (first.start, first.n_blocks) == (0, 3)
    assert second is not None and (second.start, second.n_blocks) == (3, 4)
    assert first.allocation_id != second.allocation_id
    assert allocator.used_blocks == 7 and allocator.free_blocks == 3
    assert allocator.free_ranges() == [(7, 3)]
    assert allocator.try_allocate(4) is None, "3 free blocks cannot hold 4: the answer is None, not an error"
    with pytest.raises(PoolExhausted):
        allocator.allocate(4)
    assert allocator.used_blocks == 7, "a refused allocation takes nothing"
    last = allocator.allocate(3)
    assert last.start == 7 and allocator.free_ranges() == [] and allocator.free_blocks == 0
    assert [r.start for r in allocator.live_ranges()] == [0, 3, 7]


@pytest.mark.exercise("ch04.1")
def test_first_fit_takes_the_lowest_address_that_fits_not_the_tightest() -> None:
    allocator = BlockAllocator(10)
    # Holes at [0,4) and [5,7) written straight into the free list (its two sorted lists), so that
    # this exercise is graded without free, which is ch04.2's.
    allocator._free_starts, allocator._free_sizes, allocator._used_blocks = [0, 5], [4, 2], 4
    assert allocator.free_ranges() == [(0, 4), (5, 2)]
    taken = allocator.allocate(2)
    assert taken.start == 0, "first fit: the hole at 0 comes first (best fit would pick the hole at 5)"
    assert allocator.free_ranges() == [(2, 2), (5, 2)]
    assert allocator.try_allocate(3) is None, "4 blocks are free, but no 3 of them are consecutive"


# ----------------------------------------------------------------------------- ch04.2: coalescing


@pytest.mark.exercise("ch04.2")
def test_a_freed_range_merges_with_its_left_right_and_both_neighbours() -> None:
    allocator = BlockAllocator(12)
    a, b, c, d = (allocator.allocate(3) for _ in range(4))  # [0,3) [3,6) [6,9) [9,12)
    allocator.free(a)
    assert allocator.free_ranges() == [(0, 3)]
    allocator.free(c)  # touches nothing free
    assert allocator.free_ranges() == [(0, 3), (6, 3)]
    allocator.free(b)  # bridges two free ranges: one remains
    assert allocator.free_ranges() == [(0, 9)]
    assert allocator.largest_free_range == 9
    allocator.free(d)  # merges on its left
    assert allocator.free_ranges() == [(0, 12)] and allocator.used_blocks == 0
    assert allocator.allocate(12).start == 0


@pytest.mark.exercise("ch04.2")
def test_a_freed_range_merges_with_a_free_range_on_its_right() -> None:
    allocator = BlockAllocator(8)
    a, b = allocator.allocate(4), allocator.allocate(2)  # [0,4) [4,6), [6,8) free
    allocator.free(b)
    assert allocator.free_ranges() == [(4, 4)]
    allocator.free(a)
    assert allocator.free_ranges() == [(0, 8)]


@pytest.mark.exercise("ch04.2")
@settings(derandomize=True, max_examples=60, deadline=None)  # the same examples every run: a grade must not flicker
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 100)), min_size=1, max_size=40))
def test_free_ranges_are_always_the_maximal_runs_of_free_blocks(operations: list[tuple[bool, int, int]]) -> None:
    total = 24
    allocator = BlockAllocator(total)
    free_blocks = set(range(total))  # the oracle
    live = []
    for allocate, size, pick in operations:
        if allocate or not live:
            taken = allocator.try_allocate(size)
            if taken is not None:
                blocks = set(range(taken.start, taken.end))
                assert blocks <= free_blocks, f"{taken} overlaps a live range"
                free_blocks -= blocks
                live.append(taken)
        else:
            freed = live.pop(pick % len(live))
            allocator.free(freed)
            free_blocks |= set(range(freed.start, freed.end))
        assert allocator.free_ranges() == runs(free_blocks)
        assert allocator.free_blocks == len(free_blocks)


# ----------------------------------------------------------------------------- ch04.3: sizing


@pytest.mark.exercise("ch04.3")
@pytest.mark.parametrize(
    ("longest", "concurrency", "headroom", "slots"),
    [
        (128, 8, 1.2, 1229),  # 1228.8 token slots, rounded up: a fraction of a slot is still a slot
        (100, 10, 1.0, 1000),
        (1024, 16, 1.25, 20480),
        (3, 1, 1.2, 4),
    ],
)
def test_the_pool_holds_longest_times_concurrency_times_headroom(longest: int, concurrency: int, headroom: float, slots: int) -> None:
    assert pool_tokens_by_rule(longest, concurrency, headroom) == slots


@pytest.mark.exercise("ch04.3")
def test_the_default_headroom_is_the_articles_twenty_percent() -> None:
    assert pool_tokens_by_rule(160, 20) == 3840


@pytest.mark.exercise("ch04.3")
@pytest.mark.parametrize(("longest", "concurrency", "headroom"), [(0, 8, 1.2), (128, 0, 1.2), (128, 8, 0.9)])
def test_sizes_that_make_no_sense_are_refused(longest: int, concurrency: int, headroom: float) -> None:
    with pytest.raises(ValueError):
        pool_tokens_by_rule(longest, concurrency, headroom)


# ----------------------------------------------------------------------------- ch04.4: queue or 429


class HandClock:
    """Time moved by hand (the admission controller only reads ``now``)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def wait(self, event, timeout):  # the Clock protocol; admission never waits
        raise AssertionError("admission must decide at once, never wait")


class World:
    """What the controller reads: the queue's length and the pool's used share."""

    def __init__(self) -> None:
        self.waiting = 0
        self.pool_use = 0.0


def admission(**overrides) -> tuple[AdmissionController, World, HandClock]:
    clock, world = HandClock(), World()
    config = AdmissionConfig(**{"max_waiting": 2, "fallback_slots": 0, "pressure_threshold": 0.9,
                                "pressure_duration_s": 4.0, **overrides})
    return AdmissionController(config, lambda: world.waiting, lambda: world.pool_use, clock), world, clock


def refused(controller: AdmissionController) -> ApiError:
    with pytest.raises(ApiError) as caught:
        controller.admit()
    return caught.value


@pytest.mark.exercise("ch04.4")
def test_requests_queue_while_fewer_than_max_waiting_wait_then_get_429_with_retry_after() -> None:
    controller, world, _clock = admission(max_waiting=2)
    assert controller.admit() is Route.BATCH
    world.waiting = 1
    assert controller.admit() is Route.BATCH
    world.waiting = 2  # full: max_waiting requests wait
    error = refused(controller)
    assert (error.status, error.type) == (429, "overloaded")
    assert error.headers["Retry-After"] == "1", "nothing finished yet: the minimum, 1 s"
    assert (controller.admitted, controller.rejected) == (2, 1)
    assert controller.stats()["in_flight"] == 2, "the two admitted are in flight; the refused one is not"
    world.waiting = 1  # one left the queue: room again
    assert controller.admit() is Route.BATCH and controller.admitted == 3


@pytest.mark.exercise("ch04.4")
def test_the_429_carries_the_retry_estimate_from_the_recent_time_in_the_server() -> None:
    controller, world, _clock = admission(max_waiting=3)
    for _ in range(2):
        controller.admit()
    controller.finished(5.0)  # one took 5 s; one still in flight
    world.waiting = 3
    error = refused(controller)
    assert error.headers["Retry-After"] == "20"  # 5 s x (3 waiting + 1) / 1 in flight
    assert str(error.headers["Retry-After"]) in error.message


@pytest.mark.exercise("ch04.4")
def test_a_full_queue_under_sustained_pressure_is_offloaded_up_to_the_fallback_slots() -> None:
    controller, world, clock = admission(max_waiting=1, fallback_slots=2)
    world.waiting, world.pool_use = 1, 0.95
    assert refused(controller).status == 429, "pressure starts being observed now: not sustained yet"
    clock.t += 3.5
    assert refused(controller).status == 429, "3.5 s of the 4 s"
    clock.t += 0.5
    assert controller.admit() is Route.FALLBACK, "4 s at or above the threshold, the queue full: offload"
    assert controller.admit() is Route.FALLBACK
    assert refused(controller).status == 429, "both fallback slots are taken"
    controller.fallback_done()
    assert controller.admit() is Route.FALLBACK
    assert (controller.fallback_served, controller.fallback_in_flight, controller.rejected) == (3, 2, 3)
    assert controller.admitted == 0 and controller.stats()["in_flight"] == 0, "the fallback is not the batch route"


@pytest.mark.exercise("ch04.4")
def test_pressure_is_measured_from_the_arrival_that_first_saw_it() -> None:
    controller, world, clock = admission(max_waiting=1, fallback_slots=1)
    world.pool_use = 0.95
    assert controller.admit() is Route.BATCH  # the queue has room; this arrival sees the pool at 95 %
    clock.t += 4.0
    world.waiting = 1
    assert controller.admit() is Route.FALLBACK, "pressure began at the first arrival that saw it, 4 s ago"


@pytest.mark.exercise("ch04.4")
def test_offloading_replaces_the_refusal_not_the_wait_and_ends_with_the_pressure() -> None:
    controller, world, clock = admission(max_waiting=2, fallback_slots=1)
    world.pool_use = 0.99
    controller.admit()
    clock.t += 10.0
    world.waiting = 1  # under sustained pressure, but the queue has room: wait for the fast path
    assert controller.admit() is Route.BATCH and controller.fallback_served == 0
    world.waiting, world.pool_use = 2, 0.5  # the pool recovered: a full queue is refused again
    assert refused(controller).status == 429
    world.pool_use = 0.99  # pressure again, but it starts over
    assert refused(controller).status == 429


@pytest.mark.exercise("ch04.4")
def test_with_no_fallback_slots_a_full_queue_is_always_refused() -> None:
    controller, world, clock = admission(max_waiting=1, fallback_slots=0)
    world.waiting, world.pool_use = 1, 1.0
    refused(controller)
    clock.t += 60.0
    assert refused(controller).status == 429 and controller.fallback_served == 0
