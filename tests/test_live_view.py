"""The live page's event stream: bounded per viewer, off the hot path, right about what happened, ended at exit.

Chapter 3's :mod:`~chapters.ch03_dynamic_batching.live_view` (the hub and the viewers), the
batcher's events under a fake clock, chapter 8's step events from a real step thread, and a real
server that exits promptly with a page open. The page itself is tested in a browser
(``test_live_page.py``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import requests

from chapters.ch03_dynamic_batching.batcher import BatcherConfig, DynamicBatcher
from chapters.ch03_dynamic_batching.live_view import LiveEvents, LiveView, Viewer
from chapters.ch08_continuous_batching.scheduler import Sequence
from chapters.ch08_continuous_batching.step_thread import StepThread
from tests.conftest import CLEAN_EXIT_STATUSES
from benchmarks.harness.server_process import running_server

from batcher_fakes import FakeClock, FakeModel, run
from test_ch08_scheduler import fake_setup, prompt


def parse(message: str) -> tuple[str, dict]:
    """One server-sent event: its name and its data."""
    kind = data = None
    for line in message.strip().splitlines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
    return kind, data


async def drain(viewer: Viewer) -> list[tuple[str, dict]]:
    """Every message the viewer holds now (its stream's iteration, stopped when it would wait)."""
    events = []
    stream = viewer.messages()
    while viewer.queue or viewer.dropped:
        events.append(parse(await anext(stream)))
    await stream.aclose()
    return events


# -- the hub and its viewers ------------------------------------------------------------------

def test_a_viewer_that_falls_behind_loses_its_oldest_events_and_is_told_how_many() -> None:
    async def scenario() -> None:
        events = LiveEvents()
        viewer = Viewer(capacity=8)
        stream = events.watch(viewer)
        assert parse(await anext(stream))[0] == "hello"
        for index in range(20):  # a viewer that never reads: the publisher is not held up, the queue stays bounded
            events.publish("tick", {"index": index})
            assert len(viewer.queue) <= 8
        got = [parse(await anext(stream)) for _ in range(9)]
        assert got[0] == ("dropped", {"dropped": 12, "dropped_total": 12})
        assert [data["index"] for _, data in got[1:]] == list(range(12, 20))  # the newest survive
        await stream.aclose()
        assert not events.viewers  # leaving unsubscribes

    run(scenario)


def test_nobody_watching_costs_no_event_at_all() -> None:
    events = LiveEvents()
    assert not events.watched
    events.publish("tick", {"not json": object()})  # never serialized: nobody would read it
    events.publish_threadsafe("tick", {"not json": object()})
    assert events.published == 0


def test_another_thread_publishes_through_the_loop_and_every_viewer_gets_every_event_in_order() -> None:
    async def scenario() -> None:
        events = LiveEvents(hello=lambda: {"kind": "test"})
        viewers = [Viewer(capacity=1000) for _ in range(3)]
        streams = [events.watch(viewer) for viewer in viewers]
        for stream in streams:
            assert parse(await anext(stream)) [1]["kind"] == "test"
        publisher = threading.Thread(target=lambda: [events.publish_threadsafe("tick", {"index": i}) for i in range(100)])
        publisher.start()
        publisher.join()
        for stream in streams:
            assert [parse(await anext(stream))[1]["index"] for _ in range(100)] == list(range(100))
            await stream.aclose()

    run(scenario)


def test_closing_the_live_view_ends_every_open_stream() -> None:
    async def scenario() -> None:
        events = LiveEvents()
        view = LiveView(lambda: events)
        received: list[str] = []

        async def read() -> None:
            async for message in view._stream():
                received.append(message)

        readers = [asyncio.create_task(read()) for _ in range(2)]
        while len(events.viewers) < 2:
            await asyncio.sleep(0)  # let both readers subscribe
        view.close()
        await asyncio.gather(*readers)  # would hang (the run's safety timeout) if a stream stayed open
        assert [parse(m)[0] for m in received] == ["hello", "hello"] and not events.viewers

    run(scenario)


# -- chapter 3: the batcher's decisions --------------------------------------------------------

def test_batcher_events_say_why_each_batch_left_and_carry_its_rows_and_counters() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        model = FakeModel(asyncio.get_running_loop())
        batcher = DynamicBatcher(model, BatcherConfig(max_batch=4, min_batch=3, window_s=0.005), clock=clock,
                                 describe_row=lambda r: (r, 10 * r))
        viewer = Viewer(capacity=1000)
        stream = batcher.events.watch(viewer)
        hello = parse(await anext(stream))[1]
        assert (hello["kind"], hello["max_batch"], hello["min_batch"], hello["batches"]) == ("batcher", 4, 3, 0)
        batcher.start()
        await asyncio.gather(*[batcher.enqueue(i) for i in (1, 2, 3)])  # min_batch: leaves at once
        assert await model.started.get() == [1, 2, 3]
        model.gate.clear()
        held = [batcher.enqueue(i) for i in (4, 5, 6, 7)]  # min_batch again, held on the device
        assert await model.started.get() == [4, 5, 6, 7]
        queued = [batcher.enqueue(i) for i in range(8, 14)]  # 6 wait behind it: the next batch is full
        # The model computes in a thread: let the batcher see the 6 (and park, waiting for the device)
        # before the device is freed, or the two race and the next batch may leave as min_batch.
        await clock.until_parked()
        model.gate.set()
        await asyncio.gather(*held, *queued[:4])
        await clock.until_parked()
        await clock.advance(0.005)  # the last 2 are below min_batch: their window closes
        await asyncio.gather(*queued[4:])
        await batcher.close()
        events = await drain(viewer)
        batches = [data for kind, data in events if kind == "batch"]
        assert [(b["size"], b["why"], b["full"]) for b in batches] == [
            (3, "min_batch", False), (4, "min_batch", True), (4, "device_busy", True), (2, "window", False)]
        assert batches[0]["rows"] == [[1, 10], [2, 20], [3, 30]]
        done = [data for kind, data in events if kind == "done"]
        assert [d["batch"] for d in done] == [1, 2, 3, 4] and all(not d["failed"] for d in done)
        assert (done[-1]["batches"], done[-1]["requests"], done[-1]["largest_batch"]) == (4, 13, 4) == (
            batcher.stats.batches, batcher.stats.requests, batcher.stats.largest_batch)
        queue_sizes = [data["queued"] for kind, data in events if kind == "queue"]
        assert max(queue_sizes) == 6 and len(queue_sizes) == 13  # one per arrival

    run(scenario)


# -- chapter 8: the step thread's events --------------------------------------------------------

async def watched_run(max_events_per_s: float) -> tuple[list[dict], list[Sequence], StepThread]:
    """Three sequences through a real step thread over the fake model, watched: every ``step`` event."""
    # 16 blocks of 4 tokens; three sequences that each reach 39 positions cannot all stay: preemptions.
    scheduler, runner = fake_setup(max_num_seqs=3, budget=64, policy="grow")
    thread = StepThread(runner, scheduler)
    thread.view.max_events_per_s = max_events_per_s
    viewer = Viewer(capacity=10_000)
    stream = thread.events.watch(viewer)
    assert parse(await anext(stream))[1]["kind"] == "steps"
    thread.start(asyncio.get_running_loop())
    seqs = [Sequence(prompt(20, 10 + i), 20) for i in range(3)]
    await asyncio.gather(*(thread.submit(seq).result for seq in seqs))
    thread.stop()
    # Each step's event is handed to the loop before its tokens: every one is queued by now.
    steps = [data for kind, data in await drain(viewer) if kind == "step"]
    await stream.aclose()
    return steps, seqs, thread


def test_step_events_show_who_joined_left_and_was_preempted_and_whose_blocks_are_whose() -> None:
    async def scenario() -> None:
        steps, seqs, thread = await watched_run(max_events_per_s=float("inf"))
        scheduler = thread.scheduler
        ids = {seq.seq_id for seq in seqs}
        assert {i for s in steps for i in s["joined"]} == ids
        assert sorted(i for s in steps for i, why in s["left"]) == sorted(ids)
        assert all(why == "length" for s in steps for _, why in s["left"])
        preempted = [i for s in steps for i in s["preempted"]]
        assert len(preempted) == scheduler.stats.preemptions > 0 and set(preempted) <= ids
        for step in steps:
            running = [row[0] for row in step["running"]]
            assert sorted(map(int, step["tables"])) == sorted(running)
            held = [block for table in step["tables"].values() for block in table]
            assert len(held) == len(set(held)) == step["stats"]["blocks_used"]  # no prefix caching here: no sharing
        assert [s["stats"]["steps"] for s in steps] == list(range(1, scheduler.stats.steps + 1))
        assert steps[-1]["stats"] == scheduler.describe()
        assert sum(len(s["latencies"]) for s in steps) == 3

    run(scenario)


def test_events_come_at_most_so_often_yet_none_of_what_happened_is_lost_and_the_last_step_is_always_sent() -> None:
    async def scenario() -> None:
        steps, seqs, thread = await watched_run(max_events_per_s=1e-6)  # one event, then only the last step's
        scheduler = thread.scheduler
        assert len(steps) == 2 < scheduler.stats.steps
        ids = {seq.seq_id for seq in seqs}
        assert {i for s in steps for i in s["joined"]} == ids
        assert sorted(i for s in steps for i, _ in s["left"]) == sorted(ids)  # all three left in skipped steps
        assert sum(len(s["latencies"]) for s in steps) == 3
        assert steps[-1]["stats"] == scheduler.describe() and steps[-1]["running"] == []

    run(scenario)


# -- a real server ------------------------------------------------------------------------------

def test_the_page_and_its_files_are_served_and_nothing_else_and_an_open_page_ends_with_the_server() -> None:
    """One start of chapter 3: its files (and nothing else), then SIGTERM with the page open.

    The page's stream never ends by itself; uvicorn would wait for it without ``LiveViewServer``.
    """
    with running_server("ch03") as server:
        assert f"live page: {server.url}/ui/" in server.log_tail()  # what `make serve` shows a learner
        page = requests.get(f"{server.url}/ui/", timeout=10)
        assert page.status_code == 200 and 'src="batcher.js"' in page.text
        for name in ("batcher.js", "live.js", "live.css"):
            assert requests.get(f"{server.url}/ui/{name}", timeout=10).status_code == 200
        for name in ("server.py", "..%2Fserver.py", "steps.js", "nothing.js"):
            assert requests.get(f"{server.url}/ui/{name}", timeout=10).status_code == 404, name
        with requests.get(f"{server.url}/ui/events", stream=True, timeout=30) as stream:
            lines = stream.iter_lines(decode_unicode=True)
            assert next(lines) == "event: hello"
            started = time.monotonic()
            server.process.terminate()
            server.process.wait(timeout=15)
            assert list(lines)[-1:] in ([], [""])  # the stream ended cleanly with the server
        assert time.monotonic() - started < 10
    assert server.process.returncode in CLEAN_EXIT_STATUSES


@pytest.mark.parametrize(("chapter", "script", "kind"), [("ch07", "batcher.js", "batcher"), ("ch08", "steps.js", "steps")])
def test_the_production_shell_serves_the_page_of_its_backend_and_ends_its_stream_at_the_drain(chapter: str, script: str, kind: str) -> None:
    """Chapter 7 watches its batcher, chapter 8 its step thread (the newest version's); SIGTERM drains, then ends the stream."""
    with running_server(chapter, ["--probe-interval-s", "3600"]) as server:
        assert f"live page: {server.url}/ui/" in server.log_tail()
        assert f'src="{script}"' in requests.get(f"{server.url}/ui/", timeout=10).text
        for name in (script, "live.js", "live.css"):
            assert requests.get(f"{server.url}/ui/{name}", timeout=10).status_code == 200
        with requests.get(f"{server.url}/ui/events", stream=True, timeout=30) as stream:
            lines = stream.iter_lines(decode_unicode=True)
            assert next(lines) == "event: hello" and json.loads(next(lines).removeprefix("data: "))["kind"] == kind
            started = time.monotonic()
            server.process.terminate()
            server.process.wait(timeout=20)
            list(lines)  # the stream ends with the server
        assert time.monotonic() - started < 15
    assert server.process.returncode in CLEAN_EXIT_STATUSES


def test_the_readme_block_reports_every_round_and_the_medians(tmp_path) -> None:
    from benchmarks.report.readme_blocks import live_page_cost_block

    def run(qps: float, cpu_ms: float, events: int = 0) -> dict:
        return {"qps": qps, "server_cpu_ms_per_request": cpu_ms,
                **({"viewers": [{"events": {"step": events}, "bytes": 1, "dropped_total": 2}]} if events else {})}

    rounds = [{"order": ["unwatched", "watched"], "unwatched": run(40.0, 20.0), "watched": run(38.0, 21.0, 500),
               "ratio": 0.95, "cpu_per_request_ratio": 1.05}]
    document = {"rounds": rounds, "median_ratio": 0.95, "median_cpu_per_request_ratio": 1.05, "users": 64, "workload": "default",
                "duration_s": 20, "viewers": 1, "harness": None, "command": "python -m benchmarks.studies.live_page_cost.live_page_cost --chapter ch08"}
    (tmp_path / "ch08").mkdir()
    (tmp_path / "ch08" / "live-page-cost.json").write_text(json.dumps(document))
    block = live_page_cost_block(tmp_path, "ch08")
    assert "| 1 (unwatched first) | 40.0 | 38.0 | 0.950× | 1.050× | 500 | 2 |" in block
    assert "throughput **0.950×**" in block and "per answered request **1.050×**" in block
    assert "No measurement" in live_page_cost_block(tmp_path, "ch03")
