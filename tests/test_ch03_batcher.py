"""Chapter 3's batcher, rule by rule, with a fake model and a clock the test moves by hand.

No test sleeps or measures time: the fake clock only moves when a test calls ``advance``, and
``until_parked`` returns once the batcher sits waiting with nothing left to wake it, so "has the
batch left yet?" has one deterministic answer.
"""

from __future__ import annotations

import asyncio

import pytest

from chapters.ch03_dynamic_batching.batcher import (
    BatcherConfig,
    ClientDisconnected,
    DynamicBatcher,
)
from shared.schemas import ApiError

from batcher_fakes import FakeClock, FakeModel, run


async def make(min_batch: int, max_batch: int, window_s: float = 0.005, poison: object = None):
    clock = FakeClock()
    model = FakeModel(asyncio.get_running_loop(), poison)
    batcher = DynamicBatcher(model, BatcherConfig(max_batch=max_batch, min_batch=min_batch, window_s=window_s), clock=clock)
    batcher.start()
    return batcher, model, clock


def test_window_opens_at_the_first_arrival() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=8, max_batch=32, window_s=0.005)
        first = batcher.enqueue("a")
        await clock.until_parked()
        assert clock.deadline == pytest.approx(0.005)
        await clock.advance(0.003)
        second = batcher.enqueue("b")
        await clock.until_parked()
        # The later arrival does not restart the window: it still closes 5 ms after "a".
        assert clock.deadline == pytest.approx(0.005)
        assert model.batches == [] and not first.done()
        await clock.advance(0.002)
        assert await first == "out:a" and await second == "out:b"
        assert model.batches == [["a", "b"]]
        await batcher.close()

    run(scenario)


def test_a_lone_request_leaves_when_the_window_closes() -> None:
    """The article's version never serves fewer than min_batch requests: here the wait is bounded."""

    async def scenario() -> None:
        batcher, _model, clock = await make(min_batch=8, max_batch=32, window_s=0.005)
        only = batcher.enqueue("x")
        await clock.until_parked()
        await clock.advance(0.005)
        assert await only == "out:x"
        await batcher.close()

    run(scenario)


def test_min_batch_leaves_at_once_without_waiting_for_the_window() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=3, max_batch=32, window_s=10.0)
        futures = [batcher.enqueue(i) for i in range(3)]
        assert await asyncio.gather(*futures) == ["out:0", "out:1", "out:2"]
        assert clock.time == 0.0  # the clock never moved: nobody slept after the trigger
        assert model.batches == [[0, 1, 2]]
        await batcher.close()

    run(scenario)


def test_max_batch_caps_every_batch_and_order_is_first_in_first_out() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=4, max_batch=4)
        model.gate.clear()
        first = [batcher.enqueue(i) for i in range(4)]
        assert await model.started.get() == [0, 1, 2, 3]
        rest = [batcher.enqueue(i) for i in range(4, 10)]
        model.gate.set()
        await asyncio.gather(*first)
        assert await model.started.get() == [4, 5, 6, 7]  # 6 waiting, 4 taken: the oldest
        await asyncio.gather(*rest[:4])
        await clock.until_parked()  # 2 left, below min_batch: they wait for their window
        await clock.advance(0.005)
        assert await asyncio.gather(*rest[4:]) == ["out:8", "out:9"]
        assert model.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        await batcher.close()

    run(scenario)


def test_the_next_batch_fills_while_the_device_runs_one() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=2, max_batch=8)
        model.gate.clear()
        first = [batcher.enqueue(i) for i in range(2)]
        assert await model.started.get() == [0, 1]
        # min_batch is reached and the window passes, but the device is busy: the next batch
        # waits for it and keeps growing instead of leaving with the first two arrivals.
        second = [batcher.enqueue(i) for i in range(2, 4)]
        await clock.advance(1.0)
        await clock.until_parked()
        assert batcher.queued == 2 and len(model.batches) == 1
        second += [batcher.enqueue(i) for i in range(4, 7)]
        model.gate.set()
        assert await asyncio.gather(*first, *second) == [f"out:{i}" for i in range(7)]
        assert model.batches == [[0, 1], [2, 3, 4, 5, 6]]
        assert model.max_running == 1  # one batch on the device at a time
        await batcher.close()

    run(scenario)


def test_a_failing_batch_fails_exactly_its_requests_and_the_next_batch_succeeds() -> None:
    async def scenario() -> None:
        batcher, model, _clock = await make(min_batch=3, max_batch=3, poison="bad")
        model.gate.clear()
        doomed = [batcher.enqueue(r) for r in ("a", "bad", "c")]
        await model.started.get()
        survivors = [batcher.enqueue(r) for r in ("d", "e", "f")]
        model.gate.set()
        for future in doomed:
            with pytest.raises(ApiError) as failure:
                await future
            assert (failure.value.status, failure.value.type) == (500, "batch_failed")
        assert await asyncio.gather(*survivors) == ["out:d", "out:e", "out:f"]
        assert batcher.stats.failed_batches == 1
        await batcher.close()

    run(scenario)


def test_a_client_gone_before_its_batch_starts_is_not_computed() -> None:
    async def scenario() -> None:
        batcher, model, _clock = await make(min_batch=3, max_batch=8)

        async def connected() -> bool:
            return False

        async def gone() -> bool:
            return True

        futures = [batcher.enqueue("a", connected), batcher.enqueue("left", gone), batcher.enqueue("c", connected)]
        assert await futures[0] == "out:a" and await futures[2] == "out:c"
        with pytest.raises(ClientDisconnected):
            await futures[1]
        assert model.batches == [["a", "c"]]
        assert batcher.stats.dropped_disconnected == 1
        await batcher.close()

    run(scenario)


def test_a_request_cancelled_while_its_client_is_checked_is_skipped_and_the_batcher_goes_on() -> None:
    """A deadline may cancel a request during the disconnect check's await: it must not stop the batcher."""

    async def scenario() -> None:
        batcher, model, _clock = await make(min_batch=1, max_batch=8)
        doomed: list[asyncio.Future] = []

        async def cancelled_meanwhile() -> bool:
            doomed[0].cancel()  # what a deadline does to the awaiting handler, at the worst moment
            return True  # ... and the client is gone too: the batcher must not fail the future twice

        async def connected() -> bool:
            return False

        doomed.append(batcher.enqueue("late", cancelled_meanwhile))
        kept = batcher.enqueue("kept", connected)
        assert await kept == "out:kept"
        assert model.batches == [["kept"]]
        assert await batcher.submit("next") == "out:next"  # the collector is still alive
        await batcher.close()

    run(scenario)


def test_a_cancelled_request_leaves_the_queue_and_is_not_computed() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=2, max_batch=8)
        model.gate.clear()
        running = [batcher.enqueue(i) for i in range(2)]
        await model.started.get()
        waiting = asyncio.create_task(batcher.submit("cancelled"))
        kept = asyncio.create_task(batcher.submit("kept"))
        while batcher.queued < 2:  # let both tasks reach the queue (each needs one turn of the loop)
            await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert batcher.queued == 1
        model.gate.set()
        await asyncio.gather(*running)
        await clock.until_parked()
        await clock.advance(0.005)
        assert await kept == "out:kept"
        assert model.batches == [[0, 1], ["kept"]]
        await batcher.close()

    run(scenario)


def test_a_client_cancelled_during_its_batch_does_not_break_the_others() -> None:
    """The article sets every result unconditionally: on a cancelled future that raises, mid-loop."""

    async def scenario() -> None:
        batcher, model, _clock = await make(min_batch=3, max_batch=3)
        model.gate.clear()
        tasks = [asyncio.create_task(batcher.submit(r)) for r in ("a", "b", "c")]
        assert await model.started.get() == ["a", "b", "c"]
        tasks[0].cancel()
        model.gate.set()
        assert await tasks[1] == "out:b" and await tasks[2] == "out:c"
        assert tasks[0].cancelled()
        await batcher.close()

    run(scenario)


def test_close_computes_what_is_queued_and_refuses_new_work() -> None:
    async def scenario() -> None:
        batcher, _model, clock = await make(min_batch=8, max_batch=8, window_s=60.0)
        queued = [batcher.enqueue(i) for i in range(3)]
        await clock.until_parked()
        await batcher.close()  # no window wait on the way out
        assert [f.result() for f in queued] == ["out:0", "out:1", "out:2"]
        with pytest.raises(ApiError) as refused:
            batcher.enqueue("late")
        assert refused.value.status == 503

    run(scenario)


def test_config_rejects_min_above_max() -> None:
    with pytest.raises(ValueError):
        BatcherConfig(max_batch=4, min_batch=5)
