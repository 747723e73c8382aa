"""Graded tests of chapter 3's exercises (ch03.1 the batcher's triggers, ch03.2 the FIFO cut, ch03.3 left padding).

They run unchanged against the solution and against a student tree (``python -m exercises grade``):
``chapters`` is whatever the working tree holds. Time is a fake clock moved by hand; a batch's
contents are what the fake model recorded. No test sleeps or reads a real clock. Left padding (ch03.3)
is checked against tensors written by hand and, end to end, against the oracle (``reference_greedy``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from batcher_fakes import FakeClock, FakeModel, run

from chapters.ch03_dynamic_batching.batched_generation import batched_greedy, left_pad
from chapters.ch03_dynamic_batching.batcher import (
    BatcherConfig,
    ClientDisconnected,
    DynamicBatcher,
)


class PlainCut(DynamicBatcher):
    """Chapter 3's batcher with a plain stand-in for its FIFO cut (ch03.2: no disconnect checks), so
    that the triggers (ch03.1) are graded whether or not the cut is written yet."""

    async def _take_batch(self):
        batch = []
        while self._queue and len(batch) < self.config.max_batch:
            waiting = self._queue.popleft()
            if not waiting.future.done():
                batch.append(waiting)
        return batch


async def make(min_batch: int, max_batch: int, window_s: float = 1.0, kind: type[DynamicBatcher] = DynamicBatcher):
    # Times are sums of powers of two, exact in binary: 0.003 + 0.002 would not reach 0.005.
    clock = FakeClock()
    model = FakeModel(asyncio.get_running_loop())
    batcher = kind(model, BatcherConfig(max_batch=max_batch, min_batch=min_batch, window_s=window_s), clock=clock)
    batcher.start()
    return batcher, model, clock


async def watched(batcher: DynamicBatcher, awaitable):
    """Await ``awaitable``; if the batcher's collector dies first, raise its error instead.

    A stubbed exercise raises inside the collector task; without this, a test would wait for
    something that never comes and fail on a timeout that names nothing.
    """
    waiter = asyncio.ensure_future(awaitable)
    collector = batcher._collector
    assert collector is not None
    done, _ = await asyncio.wait({waiter, collector}, return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:
        waiter.cancel()
        collector.result()  # re-raises what stopped the collector
        raise AssertionError("the batcher's collector stopped while requests were waiting")
    return waiter.result()


async def settle(batcher: DynamicBatcher, clock: FakeClock) -> None:
    """Wait until the batcher is parked on the clock with nothing due to wake it."""
    await watched(batcher, clock.until_parked())


async def until_queued(batcher: DynamicBatcher, n: int) -> None:
    """Let tasks that submit reach the queue (one turn of the loop each), unless the collector died."""
    collector = batcher._collector
    assert collector is not None
    for _ in range(100):
        if batcher.queued >= n:
            return
        if collector.done():
            collector.result()
        await asyncio.sleep(0)
    raise AssertionError(f"{batcher.queued} requests queued, expected {n}")


# ----------------------------------------------------------------------------- ch03.1: the triggers


@pytest.mark.exercise("ch03.1")
def test_the_window_is_counted_from_the_first_arrival_not_the_latest() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=8, max_batch=32, window_s=1.0, kind=PlainCut)
        first = batcher.enqueue("a")
        await settle(batcher, clock)
        assert clock.deadline == 1.0
        await clock.advance(0.5)
        second = batcher.enqueue("b")
        await settle(batcher, clock)
        assert clock.deadline == 1.0, "a later arrival must not push the window back"
        assert model.batches == []
        await clock.advance(0.5)
        assert await asyncio.gather(first, second) == ["out:a", "out:b"]
        assert model.batches == [["a", "b"]]
        await batcher.close()

    run(scenario)


@pytest.mark.exercise("ch03.1")
def test_a_lone_request_leaves_exactly_when_its_window_closes() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=4, max_batch=8, window_s=1.0, kind=PlainCut)
        only = batcher.enqueue("x")
        await settle(batcher, clock)
        await clock.advance(0.75)
        await settle(batcher, clock)
        assert model.batches == [] and not only.done()
        await clock.advance(0.25)
        assert await only == "out:x"
        assert model.batches == [["x"]]
        await batcher.close()

    run(scenario)


@pytest.mark.exercise("ch03.1")
def test_min_batch_waiting_requests_leave_at_once() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=3, max_batch=32, window_s=10.0, kind=PlainCut)
        futures = [batcher.enqueue(i) for i in range(3)]
        assert await asyncio.gather(*futures) == ["out:0", "out:1", "out:2"]
        assert clock.time == 0.0, "the clock never moved: nothing may wait once min_batch requests are queued"
        assert model.batches == [[0, 1, 2]]
        await batcher.close()

    run(scenario)


@pytest.mark.exercise("ch03.1")
def test_when_the_oldest_leaves_the_queue_the_window_belongs_to_the_next_oldest() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=8, max_batch=32, window_s=1.0, kind=PlainCut)
        cancelled = asyncio.create_task(batcher.submit("a"))
        await until_queued(batcher, 1)
        await settle(batcher, clock)
        await clock.advance(0.5)
        kept = batcher.enqueue("b")  # arrives at 0.5 s: its own window closes at 1.5 s
        await settle(batcher, clock)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await clock.advance(0.5)  # 1 s: the cancelled request's window closes, not b's
        await settle(batcher, clock)
        assert model.batches == [] and clock.deadline == 1.5
        await clock.advance(0.5)
        assert await kept == "out:b"
        assert model.batches == [["b"]]
        await batcher.close()

    run(scenario)


@pytest.mark.exercise("ch03.1")
def test_closing_computes_the_queue_without_waiting_for_the_window() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=8, max_batch=8, window_s=60.0, kind=PlainCut)
        queued = [batcher.enqueue(i) for i in range(3)]
        await settle(batcher, clock)
        await batcher.close()
        assert [f.result() for f in queued] == ["out:0", "out:1", "out:2"]
        assert clock.time == 0.0 and model.batches == [[0, 1, 2]]

    run(scenario)


# ----------------------------------------------------------------------------- ch03.2: the FIFO cut


@pytest.mark.exercise("ch03.2")
def test_a_batch_is_at_most_max_batch_of_the_oldest_requests() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=4, max_batch=4)
        model.gate.clear()  # hold the device so the queue can grow behind the first batch
        first = [batcher.enqueue(i) for i in range(4)]
        assert await watched(batcher, model.started.get()) == [0, 1, 2, 3]
        rest = [batcher.enqueue(i) for i in range(4, 10)]
        model.gate.set()
        await asyncio.gather(*first, *rest[:4])
        await settle(batcher, clock)  # two left, below min_batch: they wait for their window
        await clock.advance(1.0)
        assert await asyncio.gather(*rest[4:]) == ["out:8", "out:9"]
        assert model.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert batcher.stats.batches == 3 and batcher.stats.requests == 10
        await batcher.close()

    run(scenario)


@pytest.mark.exercise("ch03.2")
def test_clients_that_are_gone_are_dropped_counted_and_do_not_take_a_seat() -> None:
    async def scenario() -> None:
        batcher, model, clock = await make(min_batch=2, max_batch=2)

        async def connected() -> bool:
            return False

        async def gone() -> bool:
            return True

        names = ["a", "gone1", "gone2", "b", "c"]
        checks = [connected, gone, gone, connected, connected]
        futures = [batcher.enqueue(name, check) for name, check in zip(names, checks)]
        assert await asyncio.gather(futures[0], futures[3]) == ["out:a", "out:b"]
        for dropped in futures[1:3]:
            with pytest.raises(ClientDisconnected):
                await dropped
        assert model.batches[0] == ["a", "b"], "two seats, two clients still there: a and b"
        assert batcher.stats.dropped_disconnected == 2
        await settle(batcher, clock)
        await clock.advance(1.0)
        assert await futures[4] == "out:c"
        assert model.batches == [["a", "b"], ["c"]]
        await batcher.close()

    run(scenario)


@pytest.mark.exercise("ch03.2")
def test_a_request_whose_future_is_already_done_is_skipped() -> None:
    async def scenario() -> None:
        batcher, model, _clock = await make(min_batch=3, max_batch=8)
        x = batcher.enqueue("x")
        cancelled = batcher.enqueue("y")
        cancelled.cancel()  # still in the queue, but nobody waits for it any more
        z = batcher.enqueue("z")
        assert await asyncio.gather(x, z) == ["out:x", "out:z"]
        assert model.batches == [["x", "z"]]
        assert batcher.stats.dropped_disconnected == 0
        await batcher.close()

    run(scenario)


# ----------------------------------------------------------------------------- ch03.3: left padding


@pytest.mark.exercise("ch03.3")
def test_left_padding_by_hand_ids_mask_and_positions_of_real_tokens() -> None:
    input_ids, mask, positions = left_pad([[5, 6, 7], [9], [1, 2]], pad_id=0, device=torch.device("cpu"))
    expected_ids = torch.tensor([[5, 6, 7], [0, 0, 9], [0, 1, 2]])
    expected_mask = torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]])
    expected_positions = torch.tensor([[0, 1, 2], [0, 0, 0], [0, 0, 1]])  # padding: 0 (masked anyway)
    for name, got, expected in (("input_ids", input_ids, expected_ids), ("attention_mask", mask, expected_mask),
                                ("position_ids", positions, expected_positions)):
        assert got.dtype == torch.long, f"{name} must be torch.long, got {got.dtype}"
        assert got.tolist() == expected.tolist(), f"{name}: {got.tolist()} != {expected.tolist()}"


@pytest.mark.exercise("ch03.3")
def test_a_real_prompt_token_id_equal_to_the_pad_id_is_still_a_real_token() -> None:
    """The mask comes from the lengths, not from comparing ids with pad_id."""
    input_ids, mask, positions = left_pad([[257, 3], [4]], pad_id=257, device=torch.device("cpu"))
    assert input_ids.tolist() == [[257, 3], [257, 4]]
    assert mask.tolist() == [[1, 1], [0, 1]]
    assert positions.tolist() == [[0, 1], [0, 0]]


@pytest.mark.exercise("ch03.3")
def test_a_batch_without_padding_is_the_prompts_themselves() -> None:
    input_ids, mask, positions = left_pad([[1, 2, 3, 4], [5, 6, 7, 8]], pad_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert mask.tolist() == [[1] * 4] * 2 and positions.tolist() == [[0, 1, 2, 3]] * 2


@pytest.mark.exercise("ch03.3")
def test_a_padded_batch_of_mixed_lengths_returns_the_oracles_tokens_row_by_row(default_model, oracle) -> None:
    # The padded prompt pass feeds left_pad's ids, mask and positions to the model, and every decode
    # step continues from its positions: a padded row with wrong positions or mask gets other tokens.
    tokenizer = default_model.tokenizer
    prompts = [tokenizer.encode(text) for text in ("12+7=", "The cat sat on the", "a", "3+4=")]
    new_tokens = [4, 6, 3, 5]
    rows = batched_greedy(default_model.model, prompts, new_tokens, tokenizer.pad_id, prefill="padded")
    for prompt, n, row in zip(prompts, new_tokens, rows):
        assert row.output_ids == oracle(prompt, n), f"the row of a {len(prompt)}-token prompt (longest {max(map(len, prompts))})"
