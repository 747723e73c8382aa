"""Chapter 7 in-process: deadlines, readiness, drain, metrics, JSON logs, hot reload.

The real app runs on the test's event loop (httpx's ASGI transport, lifespan entered by hand). A
gate held by the test stops the model inside its decode step, so a batch stays on the device
exactly as long as the test wants; the test waits for states, not for time.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import weakref

import httpx
import pytest
from asgi_helpers import serving, serving_gated, until
from prometheus_client.parser import text_string_to_metric_families
from pythonjsonlogger.json import JsonFormatter

from chapters.ch06_tuned_batching.server import build_backend
from chapters.ch07_production.deadlines import StreamDeadline, until_disconnected
from chapters.ch07_production.request_log import REQUEST_LOG
from chapters.ch07_production.server import ProductionSettings, build_app
from chapters.ch07_production.startup_heap import freeze_startup_heap
from shared.generation import reference_greedy
from shared.schemas import ApiError

PROMPT = [5, 6, 7, 8]


class GatedModel:
    """The engine, except that each decode step waits for the test's gate."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate, self.config = inner, gate, inner.config

    @property
    def device(self):
        return self.inner.device

    @property
    def dtype(self):
        return self.inner.dtype

    def prefill(self, *args):
        return self.inner.prefill(*args)

    def decode(self, *args):
        self.gate.wait(timeout=60)
        return self.inner.decode(*args)


def settings(**overrides) -> ProductionSettings:
    base = dict(weights="default", device="cpu", engine="eager", precision="fp32", tuned_config="none",
                min_batch=1, max_batch=8, window_ms=0.0, min_window_ms=0.0, fallback_slots=0,
                pool_tokens=4 * 512, probe_interval_s=3600, admin_token="secret", max_unload_wait_s=30)
    return ProductionSettings(**{**base, **overrides})


async def no_probe() -> None:
    """The readiness probe is a real request through the batcher: a gated test keeps its batches to itself."""


def gated_app(gate: threading.Event, **overrides):
    def factory(config, loaded):
        backend = build_backend(config, loaded)
        backend.runner.model = GatedModel(backend.runner.model, gate)
        return backend
    return build_app(settings(**overrides), backend_factory=factory, probe=no_probe)


run = serving


def infer(client, prompt=PROMPT, new_tokens=3, headers=None):
    return client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": new_tokens}, headers=headers or {})


def pool_blocks_used(stats: dict) -> int:
    return sum(v["pool"]["blocks_used"] for v in stats["model_versions"].values())


def test_a_request_past_its_deadline_gets_504_and_its_batch_mates_and_the_pool_are_unaffected(oracle) -> None:
    gate = threading.Event()
    app = gated_app(gate, min_batch=2)
    version = lambda: app.state.registry.newest()  # noqa: E731

    async def scenario(client) -> None:
        late = asyncio.create_task(infer(client, headers={"X-Request-Timeout-S": "0.2"}))
        patient = asyncio.create_task(infer(client, prompt=[9, 10, 11]))
        await until(lambda: version().backend.runner.pool.stats().blocks_used > 0)  # both are in the running batch
        answer = await late
        assert answer.status_code == 504
        assert answer.json()["error"]["type"] == "deadline_exceeded"
        # queued behind the running batch, then past its deadline: it leaves the queue
        queued = asyncio.create_task(infer(client, headers={"X-Request-Timeout-S": "0.2"}))
        assert (await queued).status_code == 504
        assert version().backend.batcher.queued == 0
        gate.set()
        ok = await patient
        assert ok.status_code == 200
        assert ok.json()["output_ids"] == oracle([9, 10, 11], 3)
        await until(lambda: version().backend.runner.pool.stats().blocks_used == 0)
        assert pool_blocks_used((await client.get("/stats")).json()) == 0
        assert (await infer(client)).json()["output_ids"] == oracle(PROMPT, 3)

    asyncio.run(serving_gated(app, gate, scenario))


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf"])
def test_a_bad_timeout_header_is_a_422(value: str) -> None:
    app = build_app(settings())

    async def scenario(client) -> None:
        answer = await infer(client, headers={"X-Request-Timeout-S": value})
        assert answer.status_code == 422
        assert "X-Request-Timeout-S" in answer.json()["error"]["message"]

    asyncio.run(run(app, scenario))


def test_readiness_follows_a_real_probe_and_liveness_does_not() -> None:
    verdict = {"fail": None}

    hung = asyncio.Event()

    async def probe() -> None:
        if verdict["fail"] == "raise":
            raise RuntimeError("CUDA error: device-side assert")
        if verdict["fail"] == "hang":
            await hung.wait()

    app = build_app(settings(probe_timeout_s=0.2), probe=probe)
    production = app.state.production

    async def scenario(client) -> None:
        await production.probe.passed.wait()
        assert (await client.get("/readyz")).status_code == 200
        verdict["fail"] = "raise"
        await production.probe.run_once()
        answer = await client.get("/readyz")
        assert answer.status_code == 503 and "device-side assert" in answer.json()["reason"]
        assert (await client.get("/livez")).status_code == 200
        verdict["fail"] = "hang"
        await production.probe.run_once()
        assert "longer than" in (await client.get("/readyz")).json()["reason"]
        verdict["fail"] = None
        still = await production.probe.run_once()  # the hung probe is still running: no second one starts
        assert not still.ok and "still running" in still.reason
        hung.set()
        await production.probe._pending
        await production.probe.run_once()
        assert (await client.get("/readyz")).status_code == 200

    asyncio.run(run(app, scenario))


def test_the_real_probe_runs_a_forward_pass_through_the_served_model() -> None:
    app = build_app(settings())

    async def scenario(client) -> None:
        result = await app.state.production.probe.run_once()
        assert result.ok, result.reason
        app.state.registry.newest().loaded.model.wte = None  # break the weights: the probe must notice
        assert not (await app.state.production.probe.run_once()).ok

    asyncio.run(run(app, scenario))


def test_drain_refuses_new_requests_with_503_and_finishes_accepted_ones(oracle) -> None:
    gate = threading.Event()
    app = gated_app(gate)
    drain = app.state.drain

    async def scenario(client) -> None:
        accepted = asyncio.create_task(infer(client))
        await until(lambda: drain.in_flight == 1)
        draining = asyncio.create_task(drain.drain())
        await until(lambda: drain.draining)
        readiness = await client.get("/readyz")
        assert readiness.status_code == 503 and readiness.json()["reason"] == "draining"
        refused = await infer(client)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
        assert int(refused.headers["Retry-After"]) >= 1
        assert not draining.done()
        gate.set()
        assert (await accepted).json()["output_ids"] == oracle(PROMPT, 3)
        report = await draining
        assert report.cut_off == 0

    asyncio.run(serving_gated(app, gate, scenario))


def test_drain_gives_up_at_its_timeout_and_reports_what_it_cut_off() -> None:
    gate = threading.Event()
    app = gated_app(gate, drain_timeout_s=0.2)

    async def scenario(client) -> None:
        stuck = asyncio.create_task(infer(client))
        await until(lambda: app.state.drain.in_flight == 1)
        report = await app.state.drain.drain()
        assert report.cut_off == 1
        gate.set()
        await stuck

    asyncio.run(serving_gated(app, gate, scenario))


def metric_samples(text: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_hold_every_series_and_they_move_with_requests() -> None:
    app = build_app(settings())

    async def scenario(client) -> None:
        before = metric_samples((await client.get("/metrics")).text)
        for _ in range(3):
            assert (await infer(client)).status_code == 200
        assert (await infer(client, headers={"X-Request-Timeout-S": "0.000001"})).status_code == 504
        after = metric_samples((await client.get("/metrics")).text)
        assert total(after, "inference_request_latency_seconds_count") - total(before, "inference_request_latency_seconds_count") == 4
        assert total(after, "inference_request_total", status="200") == 3
        assert total(after, "inference_request_total", status="504") == 1
        assert total(after, "inference_errors_total", kind="timeout", type="deadline_exceeded") == 1
        assert total(after, "inference_tokens_generated_total") == 9
        for stage in ("admission", "queue", "prefill", "decode", "postprocess"):
            assert total(after, "inference_stage_latency_seconds_count", stage=stage) == 3, stage
        assert total(after, "inference_batch_size_count") == 3
        assert total(after, "inference_kv_pool_slot_bytes_total", kind="reserved") > total(before, "inference_kv_pool_slot_bytes_total", kind="reserved")
        assert total(after, "inference_kv_pool_bytes", state="total") > 0
        assert total(after, "inference_kv_pool_bytes", state="reserved") == 0
        assert "inference_queue_length" in after
        assert total(after, "inference_device_memory_bytes", kind="process_rss") > 0
        assert total(after, "inference_model_info", version="v1") == 1

    asyncio.run(run(app, scenario))


def test_one_json_log_line_per_request_with_its_id_and_never_the_prompt(caplog) -> None:
    app = build_app(settings())
    secret = "my password is hunter2"
    caplog.set_level(logging.INFO, logger=REQUEST_LOG)

    async def scenario(client) -> None:
        ok = await client.post("/v1/inference", json={"prompt": secret, "max_new_tokens": 4}, headers={"X-Request-ID": "trace-42"})
        assert ok.headers["X-Request-ID"] == "trace-42"
        bad = await client.post("/v1/inference", json={"prompt": secret, "max_new_tokens": 0})
        assert bad.status_code == 422

    asyncio.run(run(app, scenario))
    formatter = JsonFormatter("{asctime}{levelname}{name}{message}", style="{")
    lines = [json.loads(formatter.format(r)) for r in caplog.records if r.name == REQUEST_LOG]
    assert len(lines) == 2
    first, second = lines
    assert first["request_id"] == "trace-42" and first["status"] == 200 and first["model_version"] == "v1"
    assert first["input_tokens"] == len(secret.encode()) and first["output_tokens"] == 4
    assert {"queue", "prefill", "decode"} <= set(first["stages_ms"])
    assert second["status"] == 422 and second["error_type"] == "invalid_request" and second["request_id"] != "trace-42"
    assert all("hunter2" not in json.dumps(line) for line in lines)


def test_memory_snapshots_log_each_stage_of_a_request_behind_a_flag(caplog) -> None:
    import tracemalloc

    caplog.set_level(logging.INFO, logger=REQUEST_LOG)
    was_tracing = tracemalloc.is_tracing()
    app = build_app(settings(memory_snapshots=True))
    try:
        async def scenario(client) -> None:
            assert (await client.post("/v1/inference", json={"input_ids": [5, 6], "max_new_tokens": 3})).status_code == 200

        asyncio.run(run(app, scenario))
    finally:
        if not was_tracing:
            tracemalloc.stop()
    formatter = JsonFormatter("{asctime}{levelname}{name}{message}", style="{")
    [line] = [json.loads(formatter.format(r)) for r in caplog.records if r.name == REQUEST_LOG]
    assert list(line["memory"]) == ["arrival", "routed", "generated"]
    for figures in line["memory"].values():
        assert figures["process_rss_bytes"] > 0 and figures["python_traced_bytes"] > 0

    caplog.clear()
    asyncio.run(run(build_app(settings()), scenario))  # without the flag: no snapshots, no cost
    [line] = [json.loads(formatter.format(r)) for r in caplog.records if r.name == REQUEST_LOG]
    assert "memory" not in line


def test_admin_needs_the_token() -> None:
    app = build_app(settings())

    async def scenario(client) -> None:
        assert (await client.post("/admin/models", json={"version": "v2"})).status_code == 401
        wrong = await client.post("/admin/models", json={"version": "v2"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        assert list(app.state.registry.versions) == ["v1"]

    asyncio.run(run(app, scenario))


def test_hot_reload_under_load_fails_nothing_and_unloads_the_old_version(oracle) -> None:
    app = build_app(settings())
    old_model = weakref.ref(app.state.production.first.loaded.model)
    admin = {"Authorization": "Bearer secret"}
    dummy = __import__("shared.weights", fromlist=["load_model"]).load_model("dummy", seed=7)

    async def scenario(client) -> None:
        stop = asyncio.Event()
        answers: list[httpx.Response] = []

        async def client_loop() -> None:
            while not stop.is_set():
                answers.append(await infer(client))

        clients = [asyncio.create_task(client_loop()) for _ in range(3)]
        await until(lambda: len(answers) >= 3)
        loaded = await client.post("/admin/models", json={"version": "v2", "weights": "dummy", "seed": 7}, headers=admin)
        assert loaded.status_code == 201, loaded.text
        await until(lambda: "v1" not in app.state.registry.versions)
        count = len(answers)
        await until(lambda: len(answers) >= count + 3)
        stop.set()
        await asyncio.gather(*clients)
        assert all(a.status_code == 200 for a in answers), {a.status_code for a in answers}
        outputs = {tuple(a.json()["output_ids"]) for a in answers}
        assert outputs <= {tuple(oracle(PROMPT, 3)), tuple(reference_greedy(dummy.model, PROMPT, 3))}
        assert tuple(reference_greedy(dummy.model, PROMPT, 3)) in outputs
        assert (await infer(client, headers={"X-Model-Version": "v1"})).status_code == 404
        assert app.state.registry.unloaded[0].name == "v1" and not app.state.registry.unloaded[0].forced

    asyncio.run(run(app, scenario))
    import gc
    gc.collect()
    assert old_model() is None, "the old version's weights are still referenced after its unload"


# ----------------------------------------------------------------------- one deadline per stream


async def _events(gate: asyncio.Event, before: int):
    """``before`` events at once, then one more only when ``gate`` opens."""
    for index in range(before):
        yield index
    await gate.wait()
    yield before


def test_a_stream_deadline_passes_events_then_times_out_a_wait_and_leaves_the_task_usable() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        within = StreamDeadline(loop.time() + 0.2)
        events = _events(asyncio.Event(), before=3)
        assert [await within.next(events) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(TimeoutError):
            await within.next(events)  # nothing comes: the deadline cancels the wait
        assert asyncio.current_task().cancelling() == 0  # the task's own cancellation count is untouched
        await asyncio.sleep(0)  # and it can await again: no cancellation left pending
        with pytest.raises(TimeoutError):
            await within.next(events)  # past the deadline, every later call too
        await events.aclose()

    asyncio.run(scenario())


def test_a_stream_deadline_that_passes_between_events_is_seen_at_the_next_call() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        within = StreamDeadline(loop.time() + 0.05)
        gate = asyncio.Event()
        events = _events(gate, before=1)
        assert await within.next(events) == 0
        passed = loop.create_future()
        loop.call_at(within.deadline, passed.set_result, None)
        await passed  # the deadline passes while nobody waits on the stream
        gate.set()
        with pytest.raises(TimeoutError):
            await within.next(events)
        await events.aclose()

    asyncio.run(scenario())


def test_a_cancellation_that_is_not_the_deadline_stays_a_cancellation() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        within = StreamDeadline(loop.time() + 3600)
        events = _events(asyncio.Event(), before=0)
        waiting = asyncio.create_task(within.next(events))
        await asyncio.sleep(0)  # let it reach the wait
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        within.cancel()
        await events.aclose()

    asyncio.run(scenario())


# ----------------------------------------------------------------------- watching the client without polling


class Channel:
    """An ASGI receive channel: what is put in comes out, in order; counts how often it was asked."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict] = asyncio.Queue()
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        return await self.messages.get()


def test_work_that_finishes_first_returns_and_leaves_no_watcher_behind() -> None:
    async def scenario() -> None:
        channel, done = Channel(), asyncio.Event()

        async def work() -> str:
            await done.wait()
            return "answer"

        watched = asyncio.create_task(until_disconnected(work(), channel))
        while channel.calls < 1:  # the watcher waits on the channel
            await asyncio.sleep(0)
        done.set()
        assert await watched == "answer"
        assert channel.calls == 1  # one wait on the channel for the whole request: nothing polled
        await asyncio.sleep(0)  # the cancelled watcher runs its cancellation
        assert asyncio.all_tasks() == {asyncio.current_task()}  # no watcher left waiting on a finished request

    asyncio.run(scenario())


def test_a_hang_up_cancels_the_work_and_answers_499_and_body_chunks_are_not_one() -> None:
    async def scenario() -> None:
        channel, cancelled = Channel(), asyncio.Event()

        async def work() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        watched = asyncio.create_task(until_disconnected(work(), channel))
        channel.messages.put_nowait({"type": "http.request", "body": b"", "more_body": False})
        while channel.calls < 2:  # the chunk was read and the watcher waits again
            await asyncio.sleep(0)
        assert not watched.done()
        channel.messages.put_nowait({"type": "http.disconnect"})
        with pytest.raises(ApiError) as raised:
            await watched
        assert raised.value.status == 499 and raised.value.type == "client_disconnected"
        assert cancelled.is_set()

    asyncio.run(scenario())


def test_a_channel_that_fails_is_logged_and_the_work_goes_on(caplog) -> None:
    async def broken() -> dict:
        raise RuntimeError("the channel broke")

    async def scenario() -> None:
        done = asyncio.Event()

        async def work() -> str:
            await done.wait()
            return "answer"

        watched = asyncio.create_task(until_disconnected(work(), broken))

        async def logged() -> None:
            while "watching the client failed" not in caplog.text:
                await asyncio.sleep(0)  # the log line is the event; nothing else announces it

        await asyncio.wait_for(logged(), 10)
        assert not watched.done()  # not a hang-up: still waiting for its work
        done.set()
        assert await watched == "answer"

    asyncio.run(scenario())


def test_the_startup_heap_is_collected_before_it_is_frozen() -> None:
    class Node:
        pass

    garbage = Node()
    garbage.itself = garbage  # a cycle: only the collector frees it
    freed = weakref.ref(garbage)
    del garbage
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection may free it first
    try:
        frozen = freeze_startup_heap()
        assert freed() is None, "garbage still waiting for a collection was frozen, never to be freed"
        assert frozen == gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
