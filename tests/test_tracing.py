"""One trace per request (chapter 8's ``tracing.py``), received by a real OTLP/HTTP collector in the test.

The collector is a small HTTP server on 127.0.0.1 that decodes each ``ExportTraceServiceRequest``
with OpenTelemetry's own protobuf types (``opentelemetry-proto``), as Jaeger's OTLP port would. The
oracle is the trace's shape: every span of a request shares one trace id, the shell span is the
parent of the request's queue, prefill-chunk, decode and answer spans, and each names the request id.
Chapter 8 is run in-process (streamed and whole answers); chapter 9 through Serve's real proxy in
``make test-slow``, where the edge span (the proxy's process) must be the parent of the replica's
shell span (another process). Tracing off: chapter 8 started without ``--otlp-endpoint`` loads
no OpenTelemetry SDK or exporter.
"""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from asgi_helpers import serving
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from chapters.ch07_production.request_log import REQUEST_LOG
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app
from chapters.ch08_continuous_batching.tracing import REQUEST_ID_ATTRIBUTE, traces_url

ENGINE_SPANS = {"queue", "prefill chunk", "decode", "answer"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Collector:
    """An OTLP/HTTP traces endpoint on loopback: every span exported to it, decoded, and a way to wait for them."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.changed = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                collector._add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(resource.get("service.name", ""), span.name, span.trace_id.hex(), span.span_id.hex(),
                                                 span.parent_span_id.hex(), {a.key: _value(a.value) for a in span.attributes}))
        with self.changed:
            self.spans.extend(received)
            self.changed.notify_all()

    def wait_for(self, condition, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """The spans received once ``condition(spans)`` holds (woken by each export, not by a timer); a flush or
        the batch interval the tests set sends every span within a second, so 10 s without it is a failure."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not condition(self.spans):
                left = deadline - time.monotonic()
                assert left > 0, f"the collector never got the spans expected; it has {[(s.service, s.name) for s in self.spans]}"
                self.changed.wait(left)
            return list(self.spans)

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector():
    with Collector() as running:
        yield running


def by_request(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    grouped = defaultdict(list)
    for span in spans:
        grouped[span.attributes.get(REQUEST_ID_ATTRIBUTE)].append(span)
    return dict(grouped)


def assert_one_connected_trace(spans: list[ReceivedSpan], shell_parent: str = "") -> ReceivedSpan:
    """One request's spans: one trace, one shell span (child of ``shell_parent``), every other span its child. Returns the shell."""
    assert len({s.trace_id for s in spans}) == 1, [(s.name, s.trace_id) for s in spans]
    shells = [s for s in spans if s.name.startswith("POST ")]
    assert len(shells) == 1, [s.name for s in spans]
    shell = shells[0]
    assert shell.parent_id == shell_parent
    children = [s for s in spans if s is not shell]
    assert {s.name for s in children} == ENGINE_SPANS, [s.name for s in children]
    assert all(s.parent_id == shell.span_id for s in children), [(s.name, s.parent_id, shell.span_id) for s in children]
    assert sum(s.name == "queue" for s in children) == sum(s.name == "decode" for s in children) == 1
    return shell


def settings(**overrides) -> ContinuousSettings:
    base = {"weights": "default", "device": "cpu", "precision": "fp32", "pool_tokens": 2048, "max_num_seqs": 4,
            "max_num_batched_tokens": 64, "probe_interval_s": 3600, "attention": "gather"}
    return ContinuousSettings(**{**base, **overrides})


def test_traces_url_adds_otlps_path_once() -> None:
    assert traces_url("http://127.0.0.1:4318") == traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://collector/v1/traces") == "http://collector/v1/traces"


def test_chapter_8_sends_one_connected_trace_per_request_streamed_and_whole(collector, caplog) -> None:
    app = build_app(settings(otlp_endpoint=collector.url))
    long_prompt = list(range(10, 150))  # 140 tokens over a 64-token step budget: three prefill chunks
    asked = {"whole-1": (long_prompt, 6, False), "stream-1": ([5, 6, 7], 8, True), "whole-2": ([1, 2, 3, 4], 5, False)}
    answers: dict[str, httpx.Response] = {}

    async def scenario(client: httpx.AsyncClient) -> None:
        await app.state.production.probe.passed.wait()

        async def ask(request_id: str) -> None:
            prompt, new, stream = asked[request_id]
            answers[request_id] = await client.post("/v1/inference", headers={"X-Request-ID": request_id},
                                                    json={"input_ids": prompt, "max_new_tokens": new, "stream": stream})

        await asyncio.gather(*(ask(rid) for rid in asked))
        answers["anonymous"] = await client.post("/v1/inference", json={"input_ids": [9, 9], "max_new_tokens": 3})
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        answers["openai-1"] = await client.post("/v1/completions", headers={"X-Request-ID": "openai-1"},
                                                json={"model": model, "prompt": [7, 8, 9], "max_tokens": 3})

    caplog.set_level("INFO", logger=REQUEST_LOG)
    asyncio.run(serving(app, scenario))
    assert all(r.status_code == 200 for r in answers.values()), {k: r.text for k, r in answers.items()}
    assert app.state.tracing.flush()
    anonymous_id = answers["anonymous"].headers["x-request-id"]
    spans = collector.wait_for(lambda got: {*asked, anonymous_id, "openai-1"} <= set(by_request(got)))
    traces = by_request(spans)
    assert set(traces) == {*asked, anonymous_id, "openai-1"}, "a span without its request id, or a trace of the readiness probe"
    assert len({traces[rid][0].trace_id for rid in traces}) == len(traces), "two requests share a trace"
    shells = {rid: assert_one_connected_trace(request_spans) for rid, request_spans in traces.items()}
    assert all(s.service == "ch08-server" for s in spans)

    chunks = sorted((s for s in traces["whole-1"] if s.name == "prefill chunk"), key=lambda s: s.attributes["prefill.chunk"])
    starts = [c.attributes["prefill.start_position"] for c in chunks]
    assert len(chunks) >= 3 and starts == [sum(c.attributes["prefill.tokens"] for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(c.attributes["prefill.tokens"] for c in chunks) == len(long_prompt)
    assert [c.attributes["prefill.last_chunk"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    decode = next(s for s in traces["stream-1"] if s.name == "decode")
    assert decode.attributes["decode.steps"] == 8 - 1  # the first token came from the prefill's last chunk
    stream_answer = next(s for s in traces["stream-1"] if s.name == "answer")
    assert stream_answer.attributes["answer.writes"] > 1  # a stream's events, one span
    assert shells["stream-1"].attributes["http.response.status_code"] == 200

    assert shells["openai-1"].name == "POST /v1/completions"
    logged = {r.request_id: getattr(r, "trace_id", None) for r in caplog.records if r.name == REQUEST_LOG}
    assert logged == {rid: shells[rid].trace_id for rid in traces}, "a request's log line names another trace"
    # the step thread forgets each traced sequence once it ended: nothing of these requests is kept
    assert app.state.registry.newest().backend.step_thread._traced == {}


def test_a_request_that_names_its_callers_span_is_that_spans_child(collector) -> None:
    app = build_app(settings(otlp_endpoint=collector.url))
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def scenario(client: httpx.AsyncClient) -> None:
        await app.state.production.probe.passed.wait()
        response = await client.post("/v1/inference", headers={"traceparent": f"00-{caller_trace}-{caller_span}-01", "X-Request-ID": "child"},
                                     json={"input_ids": [3, 4], "max_new_tokens": 3})
        assert response.status_code == 200

    asyncio.run(serving(app, scenario))
    app.state.tracing.flush()
    spans = by_request(collector.wait_for(lambda got: "child" in by_request(got)))["child"]
    shell = assert_one_connected_trace(spans, shell_parent=caller_span)
    assert shell.trace_id == caller_trace


async def through_asgi_lifespan(app, scenario, on_shutdown_complete) -> None:
    """``scenario(client)`` between the app's start-up and shutdown driven through its ASGI interface, as uvicorn and Serve
    drive it (middlewares included); ``on_shutdown_complete()`` runs when the app reports its shutdown complete."""
    inbox: asyncio.Queue = asyncio.Queue()
    started = asyncio.Event()

    async def send(message: dict) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()
        elif message["type"] == "lifespan.shutdown.complete":
            on_shutdown_complete()
        elif message["type"].endswith(".failed"):
            raise AssertionError(message)

    await inbox.put({"type": "lifespan.startup"})
    lifespan = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, send))
    await started.wait()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as client:
        await scenario(client)
    await inbox.put({"type": "lifespan.shutdown"})
    await lifespan


def test_a_stopping_server_has_exported_every_span_when_its_shutdown_completes(collector, monkeypatch) -> None:
    """The batch's interval set past the test's length: only the flush at shutdown can export them in time."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    app = build_app(settings(otlp_endpoint=collector.url))
    at_shutdown: list[ReceivedSpan] = []

    async def scenario(client: httpx.AsyncClient) -> None:
        await app.state.production.probe.passed.wait()
        response = await client.post("/v1/inference", headers={"X-Request-ID": "last"}, json={"input_ids": [3, 4], "max_new_tokens": 3})
        assert response.status_code == 200, response.text

    asyncio.run(through_asgi_lifespan(app, scenario, lambda: at_shutdown.extend(collector.spans)))
    assert "last" in by_request(at_shutdown), [(s.name, s.attributes) for s in at_shutdown]
    assert_one_connected_trace(by_request(at_shutdown)["last"])


def test_an_edge_exports_its_spans_before_it_reports_itself_idle() -> None:
    from chapters.ch09_scale_out.stopping import DrainAtTheEdge

    order: list[str] = []

    class Signal:  # the drain signal as the edge sees it: awaitable calls, and one it does not await
        def __init__(self) -> None:
            self.draining, self.idle = asyncio.Event(), asyncio.Event()
            self.wait_draining = type("Call", (), {"remote": lambda _: self.draining.wait()})()
            self.report_idle = type("Call", (), {"remote": lambda _, edge_id: (order.append("idle"), self.idle.set())})()

    async def scenario() -> None:
        entered, release = asyncio.Event(), asyncio.Event()

        async def proxy(scope, receive, send) -> None:
            entered.set()
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        async def receive() -> dict:
            return {"type": "http.request", "body": b"{}"}

        async def send(message: dict) -> None:
            pass

        edge = DrainAtTheEdge(proxy, before_idle=lambda: order.append("flush"))
        edge._registration, edge._signal = asyncio.get_running_loop().create_future(), Signal()
        edge._registration.set_result(None)
        request = asyncio.ensure_future(edge({"type": "http", "method": "POST", "path": "/v1/inference", "headers": []}, receive, send))
        await entered.wait()  # the request is in flight at the edge
        edge._signal.draining.set()
        await edge._watch()
        assert order == []  # a request in flight: not idle yet
        release.set()
        await request
        await edge._signal.idle.wait()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert order == ["flush", "idle"]


def test_without_an_endpoint_chapter_8_loads_no_opentelemetry_sdk_or_exporter() -> None:
    """Tracing off costs nothing: the server is built and answers, and no tracer, processor or exporter was ever loaded.

    (FastAPI itself imports OpenTelemetry's API, whose tracer is a no-op until a provider is set; the
    project never sets the global one.)
    """
    script = """
import asyncio, sys, httpx
sys.path.insert(0, "tests")
from asgi_helpers import serving
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app
app = build_app(ContinuousSettings(weights="default", device="cpu", precision="fp32", pool_tokens=2048, max_num_seqs=4,
                                   probe_interval_s=3600, attention="gather"))
async def scenario(client):
    await app.state.production.probe.passed.wait()
    assert (await client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 2})).status_code == 200
asyncio.run(serving(app, scenario))
assert type(app.state.backend).__name__ and app.state.tracing is None
print(sorted(name for name in sys.modules if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto"))))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------- through Serve (chapter 9, real Ray)


def test_the_edge_span_is_inside_the_drain_and_sends_its_span_on_in_the_traceparent_of_the_scope_it_passes_in(collector, monkeypatch) -> None:
    """Chapter 9's edge without Ray: what Serve's proxy would receive names the edge span, in W3C's format."""
    from chapters.ch08_continuous_batching.tracing import OTLP_ENDPOINT_ENV
    from chapters.ch09_scale_out.edge import TraceAtTheEdge, edge_tracing, proxy_middlewares, traced_edge
    from chapters.ch09_scale_out.stopping import DrainAtTheEdge

    monkeypatch.setenv(OTLP_ENDPOINT_ENV, collector.url)
    composed = [middleware.cls for middleware in proxy_middlewares()]  # Serve wraps them in order: the last is outermost
    assert composed[-2:] == [TraceAtTheEdge, DrainAtTheEdge]  # the drain counts a request until its edge span has ended
    client_trace, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    passed_in: dict[bytes, bytes] = {}

    async def proxy(scope, receive, send) -> None:
        passed_in.update(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"edge-1")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: dict) -> None:
        pass

    edge = proxy
    for middleware in traced_edge(edge_tracing()):  # as Serve composes them: each wraps the ones before it
        edge = middleware.cls(edge, *middleware.args, **middleware.kwargs)
    assert isinstance(edge, TraceAtTheEdge)
    scope = {"type": "http", "method": "POST", "path": "/v1/inference",
             "headers": [(b"traceparent", f"00-{client_trace}-{client_span}-01".encode())]}
    asyncio.run(edge(scope, receive, send))
    edge.tracing.flush()
    [span] = collector.wait_for(lambda got: len(got) >= 1)
    assert (span.service, span.name, span.trace_id, span.parent_id) == ("ch09-edge", "edge POST /v1/inference", client_trace, client_span)
    assert span.attributes[REQUEST_ID_ATTRIBUTE] == "edge-1"
    assert passed_in[b"traceparent"] == f"00-{client_trace}-{span.span_id}-01".encode()


@pytest.mark.slow
def test_through_serve_the_edge_span_is_the_parent_of_the_replicas_spans(collector) -> None:
    from benchmarks.harness.server_process import running_module

    args = ["--num-replicas", "1", "--spare-replicas", "0", "--replica-cpus", "0.5", "--device", "cpu", "--precision", "fp32", "--attention", "gather",
            "--torch-threads", "1", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--probe-interval-s", "3600",
            "--drain-timeout-s", "10", "--otlp-endpoint", collector.url]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # the SDK's batch interval (ms), read in every process: spans arrive soon
    asked = ("via-serve-whole", "via-serve-stream", "via-serve-openai")  # one request id across each trace, edge included
    with running_module("chapters.ch09_scale_out", args, name="ch09-tracing", env=env, startup_timeout_s=240) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            whole = client.post("/v1/inference", headers={"X-Request-ID": "via-serve-whole"}, json={"input_ids": [5, 6, 7], "max_new_tokens": 4})
            assert whole.status_code == 200, whole.text
            with client.stream("POST", "/v1/inference", headers={"X-Request-ID": "via-serve-stream"},
                               json={"input_ids": [1, 2, 3], "max_new_tokens": 4, "stream": True}) as streamed:
                assert streamed.status_code == 200
                assert "event: done" in streamed.read().decode()
            model = client.get("/v1/models").json()["data"][0]["id"]
            completion = client.post("/v1/completions", headers={"X-Request-ID": "via-serve-openai"},
                                     json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4})
            assert completion.status_code == 200, completion.text

        def complete(got: list[ReceivedSpan]) -> bool:
            traces = by_request(got)
            return all(len(traces.get(rid, [])) >= 1 + 1 + len(ENGINE_SPANS) for rid in asked)

        spans = collector.wait_for(complete)
    for rid, request_spans in by_request(spans).items():
        if rid not in asked:
            continue
        edges = [s for s in request_spans if s.service == "ch09-edge"]
        assert len(edges) == 1 and edges[0].parent_id == "", [(s.service, s.name) for s in request_spans]
        replica = [s for s in request_spans if s.service == "ch08-server"]
        shell = assert_one_connected_trace(replica, shell_parent=edges[0].span_id)
        assert shell.trace_id == edges[0].trace_id
        assert edges[0].attributes["http.response.status_code"] == 200
