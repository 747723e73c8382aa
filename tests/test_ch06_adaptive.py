"""Chapter 6's adaptive window, driven by the same hand-moved clock as chapter 3's batcher tests."""

from __future__ import annotations

import asyncio

import pytest

from batcher_fakes import FakeClock, FakeModel, run
from chapters.ch03_dynamic_batching.batcher import BatcherConfig
from chapters.ch06_tuned_batching.adaptive_window import AdaptiveBatcher, ArrivalRate

WINDOW_S = 0.005
MIN_WINDOW_S = 0.001


def test_arrival_rate_is_a_weighted_mean_of_gaps() -> None:
    rate = ArrivalRate(smoothing=0.5)
    assert rate.expected_within(WINDOW_S, now=0.0) == 0.0  # nothing seen: expect nobody
    for t in (0.0, 0.002, 0.004):
        rate.observe(t)
    assert rate.mean_gap_s == pytest.approx(0.002)
    rate.observe(0.008)  # gap 0.004: mean 0.002 + 0.5 * (0.004 - 0.002)
    assert rate.mean_gap_s == pytest.approx(0.003)
    assert rate.expected_within(0.006, now=0.008) == pytest.approx(2.0)  # the mean is the shorter gap


def test_a_burst_after_a_long_silence_counts_at_once() -> None:
    """A closed loop on a GPU: a batch computes for 100 ms, then its 16 users come back together."""
    rate = ArrivalRate()
    for t in (0.0, 0.1, 0.2, 0.3):  # one arrival per 100 ms batch so far
        rate.observe(t)
    assert rate.expected_within(WINDOW_S, now=0.3) < 1.0  # a lone arrival after the silence: no company known
    rate.observe(0.3003)  # the burst's second request, 0.3 ms later
    assert rate.mean_gap_s > 0.05  # the mean still remembers the silences ...
    assert rate.expected_within(WINDOW_S, now=0.3003) >= 1.0  # ... the latest gap says company is here


def test_a_long_silence_lowers_the_expected_arrivals() -> None:
    rate = ArrivalRate()
    for t in (0.0, 0.0005, 0.001):
        rate.observe(t)
    assert rate.expected_within(WINDOW_S, now=0.001) >= 1.0
    assert rate.expected_within(WINDOW_S, now=1.0) == pytest.approx(WINDOW_S / 0.999)


async def make(min_batch: int = 8, max_batch: int = 32) -> tuple[AdaptiveBatcher, FakeModel, FakeClock]:
    clock = FakeClock()
    model = FakeModel(asyncio.get_running_loop())
    config = BatcherConfig(max_batch=max_batch, min_batch=min_batch, window_s=WINDOW_S)
    batcher = AdaptiveBatcher(model, config, clock=clock, min_window_s=MIN_WINDOW_S)
    batcher.start()
    return batcher, model, clock


def test_a_lone_request_waits_about_a_millisecond() -> None:
    """One user in a closed loop: the next request only comes after this answer, so waiting buys nothing."""

    async def scenario() -> None:
        batcher, model, clock = await make()
        for round_ in range(3):
            arrived = clock.time
            future = batcher.enqueue(f"r{round_}")
            await clock.until_parked()
            assert clock.deadline == pytest.approx(arrived + MIN_WINDOW_S)
            await clock.advance(MIN_WINDOW_S)
            assert await future == f"out:r{round_}"
            await clock.advance(0.060)  # the client reads the answer and thinks before asking again
        assert model.batches == [["r0"], ["r1"], ["r2"]]
        await batcher.close()

    run(scenario)


def test_under_load_the_window_grows_and_batches_fill() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=8)
        # A burst: arrivals every 0.2 ms, so about 25 are expected within the 5 ms window.
        futures = []
        for i in range(4):
            futures.append(batcher.enqueue(i))
            await clock.advance(0.0002)
        await clock.until_parked()
        assert clock.deadline == pytest.approx(WINDOW_S)  # the full window, from the first arrival
        for i in range(4, 8):  # the window is still open: these join, and min_batch sends it at once
            futures.append(batcher.enqueue(i))
        assert await asyncio.gather(*futures) == [f"out:{i}" for i in range(8)]
        assert model.batches == [list(range(8))]
        await batcher.close()

    run(scenario)


def test_a_burst_that_starts_after_a_busy_silence_leaves_as_one_batch() -> None:
    """The GPU case: after a silence the burst's first request opens a 1 ms window; the second one,
    0.2 ms later, widens it to the full window, so the burst is not split into a lone request and the rest."""

    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=16, max_batch=64)
        for round_ in range(3):  # earlier batches, one user each, 100 ms apart
            future = batcher.enqueue(f"lone{round_}")
            await clock.until_parked()
            await clock.advance(MIN_WINDOW_S)
            await future
            await clock.advance(0.1)
        futures = [batcher.enqueue(0)]
        await clock.until_parked()
        assert clock.deadline == pytest.approx(clock.time + MIN_WINDOW_S)  # alone so far: the short window
        opened = clock.time
        await clock.advance(0.0002)
        futures += [batcher.enqueue(i) for i in range(1, 6)]  # the rest of the burst
        await clock.until_parked()
        assert clock.deadline == pytest.approx(opened + WINDOW_S)  # company came: the full window
        await clock.advance(WINDOW_S)
        assert await asyncio.gather(*futures) == [f"out:{i}" for i in range(6)]
        assert model.batches[-1] == list(range(6))
        await batcher.close()

    run(scenario)


def test_a_fixed_window_would_have_made_the_lone_request_wait_the_full_window() -> None:
    """The contrast the lesson draws: chapter 3's batcher holds the same lone request for 5 ms."""

    async def scenario() -> None:
        from chapters.ch03_dynamic_batching.batcher import DynamicBatcher

        clock = FakeClock()
        model = FakeModel(asyncio.get_running_loop())
        batcher = DynamicBatcher(model, BatcherConfig(max_batch=32, min_batch=8, window_s=WINDOW_S), clock=clock)
        batcher.start()
        batcher.enqueue("alone")
        await clock.until_parked()
        assert clock.deadline == pytest.approx(WINDOW_S)
        await clock.advance(WINDOW_S)
        await batcher.close()

    run(scenario)
