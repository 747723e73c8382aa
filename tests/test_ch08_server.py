"""Chapter 8's server in-process (httpx's ASGI transport): the contract, /stats, overload, deadlines, failures.

A gate around the model holds the step thread between steps when a test needs a state to last; tests wait
for states, never for time. Each scenario first waits for chapter 7's readiness probe (one real
request through the step thread at start-up) and counts from there. Streams and disconnects need a real
socket: test_ch08_streaming.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
from pathlib import Path

import httpx
import pytest
from asgi_helpers import serving, until
from prometheus_client.parser import text_string_to_metric_families
from sampling_oracle import reference_sampled

from chapters.ch07_production.server import ProductionSettings
from chapters.ch07_production.server import build_app as build_chapter7
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app
from chapters.ch08_continuous_batching.continuous_metrics import StepClock, StepRecord
from chapters.ch08_continuous_batching.streaming import write_sse_stream
from shared.schemas import ValidRequest

CH07_DEPLOY = Path(__file__).parent.parent / "chapters" / "ch07_production" / "deploy"
CH08_DEPLOY = Path(__file__).parent.parent / "chapters" / "ch08_continuous_batching" / "deploy"


class GatedModel:
    """The real model, but each packed step waits for the test to open the gate (or fails, when told to)."""

    def __init__(self, model) -> None:
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def forward_packed(self, *args):
        assert self.gate.wait(timeout=60)
        if self.fail:
            raise RuntimeError("injected failure")
        return self.model.forward_packed(*args)


def settings(**overrides) -> ContinuousSettings:
    base = {"weights": "default", "device": "cpu", "precision": "fp32", "pool_tokens": 2048, "max_num_seqs": 4,
            "max_num_batched_tokens": 64, "probe_interval_s": 3600}
    return ContinuousSettings(**{**base, **overrides})


def run(app, scenario, gate: GatedModel | None = None) -> None:
    """``scenario`` once the start-up probe has passed; a gate is opened however the scenario ends."""
    async def started(client: httpx.AsyncClient) -> None:
        await app.state.production.probe.passed.wait()
        try:
            await scenario(client)
        finally:
            if gate is not None:
                gate.gate.set()

    asyncio.run(serving(app, started))


def step_thread_of(app):
    """The step thread of the version now serving (chapter 7's registry holds one backend per version)."""
    return app.state.registry.newest().backend.step_thread


def test_inference_returns_the_oracles_tokens_with_the_contracts_fields(oracle) -> None:
    app = build_app(settings())
    prompts = [([5, 6, 7], 9), (list(range(40, 100)), 20), ([1], 1)]

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*(client.post("/v1/inference", json={"input_ids": p, "max_new_tokens": n}) for p, n in prompts))
        for answer, (p, n) in zip(answers, prompts):
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["output_ids"] == oracle(p, n)
            assert body["usage"] == {"prompt_tokens": len(p), "completion_tokens": n, "total_tokens": len(p) + n}
            assert {"queue", "prefill", "ttft", "decode", "total"} <= set(body["timings_ms"])
            assert answer.headers["X-Request-ID"] == body["request_id"]
        stats = (await client.get("/stats")).json()["scheduler"]
        assert stats["finished"] == 3 + 1 and stats["blocks_used"] == 0  # and the start-up probe and stats["blocks_free"] == stats["blocks_total"]
        assert stats["running"] == stats["waiting"] == 0 and stats["tokens_per_step"] > 0

    run(app, scenario)


def test_inference_samples_with_a_seed_streamed_or_not_and_greedy_neighbours_keep_the_oracles_tokens(oracle, default_model) -> None:
    app = build_app(settings())
    prompt = list(b"Once upon a time, ")
    sampled = {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 5}
    wanted = reference_sampled(default_model.model, prompt, 20, **sampled)

    async def scenario(client: httpx.AsyncClient) -> None:
        body = {"input_ids": prompt, "max_new_tokens": 20, **sampled}
        answers = await asyncio.gather(client.post("/v1/inference", json=body),
                                       client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": 20}),
                                       client.post("/v1/inference", json={**body, "stream": True}))
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
        assert answers[0].json()["output_ids"] == wanted
        assert answers[1].json()["output_ids"] == oracle(prompt, 20)
        done = [json.loads(line.removeprefix("data: ")) for line in answers[2].text.splitlines() if line.startswith("data: ")][-1]
        assert done["output_ids"] == wanted
        schema = (await client.get("/openapi.json")).json()["paths"]["/v1/inference"]["post"]["requestBody"]["content"]
        assert {"temperature", "top_k", "top_p", "seed", "stream"} <= set(schema["application/json"]["schema"]["properties"])

    run(app, scenario)


@pytest.mark.parametrize("field", [{"temperature": 2.5}, {"top_p": 0}, {"top_k": -1}, {"seed": "x"}, {"logprobs": 2}])
def test_out_of_range_sampling_fields_get_a_422_naming_the_field(field: dict) -> None:
    app = build_app(settings())

    async def scenario(client: httpx.AsyncClient) -> None:
        answer = await client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 4, **field})
        assert answer.status_code == 422 and next(iter(field)) in answer.json()["error"]["message"]
        assert (await client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 4})).status_code == 200

    run(app, scenario)


@pytest.mark.parametrize(
    ("body", "status", "type_"),
    [
        ({"input_ids": [1, 2], "max_new_tokens": 4, "stream": "yes"}, 422, "invalid_request"),
        ({"input_ids": [1, 2], "max_new_tokens": 600}, 422, "invalid_request"),
        ({"input_ids": list(range(200)) * 2, "max_new_tokens": 200}, 422, "context_exceeded"),
        ({"input_ids": [999], "max_new_tokens": 4, "stream": True}, 422, "invalid_request"),
    ],
)
def test_bad_requests_get_the_contracts_error_before_any_stream_starts(body: dict, status: int, type_: str) -> None:
    app = build_app(settings())

    async def scenario(client: httpx.AsyncClient) -> None:
        answer = await client.post("/v1/inference", json=body)
        assert answer.status_code == status and answer.json()["error"]["type"] == type_
        assert (await client.post("/v1/inference", content=b"{not json")).status_code == 400

    run(app, scenario)


def test_streaming_is_served_only_where_a_backend_streams_and_the_app_was_given_a_writer() -> None:
    """Chapter 2's route, not a swapped one: without a writer ``stream`` is an unknown field (chapter 7),
    and a writer given for a backend that cannot stream stops the server at start-up."""
    chapter7 = ProductionSettings(weights="default", device="cpu", engine="eager", precision="fp32", tuned_config="none",
                                  pool_tokens=2048, fallback_slots=0, probe_interval_s=3600)
    with pytest.raises(TypeError, match="does not stream"):
        build_chapter7(chapter7, stream_writer=write_sse_stream)
    app = build_chapter7(chapter7)

    async def scenario(client: httpx.AsyncClient) -> None:
        answer = await client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 2, "stream": True})
        assert answer.status_code == 422 and "stream" in answer.json()["error"]["message"]
        schema = (await client.get("/openapi.json")).json()["paths"]["/v1/inference"]["post"]["requestBody"]
        assert "stream" not in schema["content"]["application/json"]["schema"]["properties"]

    run(app, scenario)
    [route] = [r for r in build_app(settings()).routes if getattr(r, "path", None) == "/v1/inference"]
    assert "stream" in route.openapi_extra["requestBody"]["content"]["application/json"]["schema"]["properties"]


def test_past_max_num_seqs_plus_max_queue_requests_get_429_with_retry_after() -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(max_num_seqs=1, max_num_batched_tokens=1, max_queue=1), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]

    async def scenario(client: httpx.AsyncClient) -> None:
        gate.gate.clear()
        inside = [asyncio.create_task(client.post("/v1/inference", json={"input_ids": [i], "max_new_tokens": 2})) for i in (1, 2)]
        await until(lambda: app.state.drain.in_flight == 2)
        refused = await client.post("/v1/inference", json={"input_ids": [3], "max_new_tokens": 2})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "overloaded"
        assert int(refused.headers["Retry-After"]) >= 1
        gate.gate.set()
        assert [r.status_code for r in await asyncio.gather(*inside)] == [200, 200]

    run(app, scenario, gate)


def test_a_failing_step_fails_its_requests_with_500_frees_their_blocks_and_the_server_goes_on(oracle) -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]

    async def scenario(client: httpx.AsyncClient) -> None:
        step_thread = step_thread_of(app)
        gate.fail = True
        failed = await client.post("/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 5})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "batch_failed"
        gate.fail = False
        ok = await client.post("/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 5})
        assert ok.status_code == 200 and ok.json()["output_ids"] == oracle([1, 2, 3], 5)
        assert step_thread.scheduler.manager.used_blocks == 0 and step_thread.failed_steps == 1

    run(app, scenario, gate)


def test_a_request_past_its_deadline_gets_504_and_its_blocks_back_within_one_step(oracle) -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]

    async def scenario(client: httpx.AsyncClient) -> None:
        step_thread = step_thread_of(app)
        gate.gate.clear()  # the step thread stops inside its next step
        late = asyncio.create_task(client.post("/v1/inference", json={"input_ids": list(range(1, 40)), "max_new_tokens": 50},
                                               headers={"X-Request-Timeout-S": "0.05"}))
        alive = asyncio.create_task(client.post("/v1/inference", json={"input_ids": [4, 5], "max_new_tokens": 3}))
        await until(lambda: step_thread.scheduler.manager.used_blocks > 0)  # both are in the step the gate holds
        answer = await late  # the shell's deadline passes while the step thread is held
        assert answer.status_code == 504 and answer.json()["error"]["type"] == "deadline_exceeded"
        gate.gate.set()
        assert (await alive).json()["output_ids"] == oracle([4, 5], 3)
        await until(lambda: step_thread.scheduler.manager.used_blocks == 0)
        assert step_thread.scheduler.stats.aborted == 1

    run(app, scenario, gate)


def test_the_server_wide_deadline_flag_turns_a_long_request_into_504() -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(request_timeout_s=0.05), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]

    async def scenario(client: httpx.AsyncClient) -> None:
        gate.gate.clear()
        answer = await client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 5})
        assert answer.status_code == 504 and answer.json()["error"]["type"] == "deadline_exceeded"

    run(app, scenario, gate)


def dashboard_series(path: Path) -> set[str]:
    """The metric names a Grafana dashboard's queries use (histogram suffixes and _total kept as written)."""
    dashboard = json.loads(path.read_text())
    return {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"\b(inference_[a-z_]+)", t["expr"])}


def test_metrics_add_token_latencies_sequences_blocks_and_steps_and_both_dashboards_query_only_what_exists(oracle) -> None:
    app = build_app(settings())
    prompts = [([5, 6, 7], 9), ([1, 2], 4), ([9], 1)]

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*(client.post("/v1/inference", json={"input_ids": p, "max_new_tokens": n}) for p, n in prompts))
        assert [a.json()["output_ids"] for a in answers] == [oracle(p, n) for p, n in prompts]
        text = (await client.get("/metrics")).text
        families = list(text_string_to_metric_families(text))
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
        # a labelled series with no sample yet (no error so far) is still declared: its family counts
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        names = {name for name, _ in samples} | {f.name + end for f in families for end in suffixes.get(f.type, ("",))}
        scheduler = (await client.get("/stats")).json()["scheduler"]

        def value(name: str, **labels) -> float:
            return samples[(name, tuple(sorted({"version": "v1", **labels}.items())))]

        finished = len(prompts) + 1  # and the start-up probe
        assert value("inference_time_to_first_token_seconds_count") == finished
        assert value("inference_time_per_output_token_seconds_count") == finished - 1  # the one-token answer has no TPOT
        assert value("inference_sequences", state="running") == value("inference_sequences", state="waiting") == 0
        assert value("inference_kv_blocks", state="used") == 0 and value("inference_kv_blocks", state="free") == scheduler["blocks_total"]
        assert value("inference_steps_total") == scheduler["steps"]
        assert value("inference_step_tokens_total", kind="prefill") + value("inference_step_tokens_total", kind="decode") == scheduler["tokens_computed"]
        assert value("inference_preemptions_total") == scheduler["preemptions"]
        for dashboard in (CH07_DEPLOY / "grafana-dashboard.json", CH08_DEPLOY / "grafana-continuous-batching.json"):
            for name in dashboard_series(dashboard):
                assert name in names, f"{dashboard.parent.parent.name}'s dashboard queries {name}, which the server does not export"

    run(app, scenario)


def sse_events(body: str) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in body.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_a_drain_with_an_open_stream_refuses_new_work_and_lets_the_stream_finish(oracle) -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate, drain = gated[0], app.state.drain

    async def scenario(client: httpx.AsyncClient) -> None:
        gate.gate.clear()
        stream = asyncio.create_task(client.post("/v1/inference", json={"input_ids": [5, 6, 7], "max_new_tokens": 6, "stream": True}))
        await until(lambda: drain.in_flight == 1)
        draining = asyncio.create_task(drain.drain())
        await until(lambda: drain.draining)
        readiness = await client.get("/readyz")
        assert readiness.status_code == 503 and readiness.json()["reason"] == "draining"
        refused = await client.post("/v1/inference", json={"input_ids": [1], "max_new_tokens": 2, "stream": True})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
        assert not draining.done()
        gate.gate.set()
        events = sse_events((await stream).text)
        assert [e for e, _ in events] == ["token"] * 6 + ["done"]
        assert events[-1][1]["output_ids"] == oracle([5, 6, 7], 6)
        assert (await draining).cut_off == 0

    run(app, scenario, gate)


def test_a_deadline_in_the_middle_of_a_stream_ends_it_with_an_error_event_and_frees_its_blocks() -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]

    async def scenario(client: httpx.AsyncClient) -> None:
        step_thread = step_thread_of(app)
        gate.gate.clear()  # the stream has started (200 sent at admission); no token comes before its deadline
        answer = await client.post("/v1/inference", json={"input_ids": list(range(1, 30)), "max_new_tokens": 40, "stream": True},
                                   headers={"X-Request-Timeout-S": "0.1"})
        assert answer.status_code == 200
        events = sse_events(answer.text)
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "deadline_exceeded", events
        gate.gate.set()
        await until(lambda: step_thread.scheduler.manager.used_blocks == 0 and step_thread.scheduler.stats.aborted == 1)
        assert app.state.drain.in_flight == 0 and app.state.registry.newest().in_flight == 0

    run(app, scenario, gate)


def test_hot_reload_with_a_stream_open_drops_nothing_and_unloads_the_old_version(oracle) -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(admin_token="secret", attention="gather"), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[-1])
    first = gated[0]
    admin = {"Authorization": "Bearer secret"}

    async def scenario(client: httpx.AsyncClient) -> None:
        registry = app.state.registry
        first.gate.clear()
        stream = asyncio.create_task(client.post("/v1/inference", json={"input_ids": [5, 6, 7], "max_new_tokens": 5, "stream": True}))
        await until(lambda: registry.versions["v1"].in_flight == 1)
        loaded = await client.post("/admin/models", json={"version": "v2", "weights": "default"}, headers=admin)
        assert loaded.status_code == 201, loaded.text
        on_v2 = await client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 3})
        assert on_v2.json()["output_ids"] == oracle([1, 2], 3)
        assert "v1" in registry.versions and registry.versions["v1"].retired  # still streaming: not unloaded
        first.gate.set()
        events = sse_events((await stream).text)
        assert events[-1][0] == "done" and events[-1][1]["output_ids"] == oracle([5, 6, 7], 5)
        await until(lambda: len(registry.unloaded) == 1)  # its step thread stopped, its pool dropped
        assert [(u.name, u.forced) for u in registry.unloaded] == [("v1", False)] and "v1" not in registry.versions

    run(app, scenario, first)


def test_a_stream_admitted_but_never_read_gives_back_every_count() -> None:
    # A response cancelled before its first byte never starts its body: no finally runs in it.
    app = build_app(settings())

    async def scenario(client: httpx.AsyncClient) -> None:
        backend = app.state.registry.newest().backend
        stream = await app.state.production.open_stream(ValidRequest([1, 2], 3))
        assert app.state.drain.in_flight == 1 and app.state.registry.newest().in_flight == 1
        del stream
        gc.collect()
        assert app.state.drain.in_flight == 0 and app.state.registry.newest().in_flight == 0
        await until(lambda: backend.in_flight == 0)  # its sequence still ran to its end, nobody reading
        assert backend.step_thread.scheduler.manager.used_blocks == 0

    run(app, scenario)


def test_stats_read_while_the_step_thread_records_a_step_still_answers() -> None:
    """/stats reads the step clock on the event loop while the step thread appends to it: the read
    copies the recent steps first (a live-page CI run once got a 500, "deque mutated during iteration")."""
    clock = StepClock(keep=8)
    later = StepRecord(2, 2, 0, 2, 0.1, 0.1, 0.1, 0.1)

    class StepLandsWhileRead(int):
        """Reading this field is the moment the step thread records its next step."""

        def __deepcopy__(self, memo: dict) -> int:
            clock.record(later)
            return int(self)

    clock.record(StepRecord(StepLandsWhileRead(1), 1, 0, 1, 0.1, 0.1, 0.1, 0.1))
    described = clock.describe()
    assert [step["tokens"] for step in described["recent"]] == [1], "the read shows the steps as of its start"
    assert [step.tokens for step in clock.recent] == [1, 2], "and the step recorded meanwhile is kept"


def test_every_route_that_generates_is_logged_counted_and_answered_with_a_request_id(caplog) -> None:
    """Chapter 7's shell sees the OpenAI routes as it sees ``/v1/inference``: an ``X-Request-ID`` on every
    answer (errors and streams included), one JSON log line each, and the latency histogram's count."""
    import logging

    from chapters.ch07_production.request_log import REQUEST_LOG

    app = build_app(settings())
    caplog.set_level(logging.INFO, logger=REQUEST_LOG)
    model = "tiny-default"
    calls = [
        ("/v1/inference", {"input_ids": [5, 6, 7], "max_new_tokens": 3}, 200),
        ("/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 3}, 200),
        ("/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}, 200),
        ("/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 0}, 422),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}, 400),  # no template
    ]

    def latency_count(text: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "inference_request_latency_seconds_count")

    async def scenario(client: httpx.AsyncClient) -> None:
        before = latency_count((await client.get("/metrics")).text)
        caplog.clear()
        for i, (path, body, status) in enumerate(calls):
            answer = await client.post(path, json=body, headers={"X-Request-ID": f"route-{i}"})
            assert answer.status_code == status, (path, answer.text)
            assert answer.headers["X-Request-ID"] == f"route-{i}", path
        assert latency_count((await client.get("/metrics")).text) - before == len(calls)

    run(app, scenario)
    lines = [r for r in caplog.records if r.name == REQUEST_LOG]
    assert [(r.request_id, r.status) for r in lines] == [(f"route-{i}", status) for i, (_, _, status) in enumerate(calls)]
    assert [r.output_tokens for r in lines[:3]] == [3, 3, 3]


def test_a_list_of_prompts_gets_one_sentence_not_pydantics_union_report() -> None:
    app = build_app(settings())

    async def scenario(client: httpx.AsyncClient) -> None:
        answer = await client.post("/v1/completions", json={"model": "tiny-default", "prompt": ["hi", "yo"], "max_tokens": 2})
        assert answer.status_code == 422
        message = answer.json()["error"]["message"]
        assert message.startswith("prompt: one string or one list of token ids") and "union" not in message.lower()

    run(app, scenario)
