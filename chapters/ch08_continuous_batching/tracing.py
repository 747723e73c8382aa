"""One OpenTelemetry trace per request, exported over OTLP/HTTP to ``--otlp-endpoint``: the shell span (its parent the caller's
W3C ``traceparent``), the engine's spans (:mod:`.step_tracing`) and ``answer``, each with ``request.id``; the request log line
names ``trace_id`` and ``span_id``. OpenTelemetry is imported only when tracing, engine code never (chapter 9's edge uses it)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from shared.schemas import REQUEST_ID_HEADER, request_id_from

OTLP_ENDPOINT_ENV = "SFS_OTLP_ENDPOINT"  # the --otlp-endpoint flag's variable (shared/settings.py's rule)
SERVER_SERVICE = "ch08-server"
TRACED_PATHS = ("/v1/inference", "/v1/completions", "/v1/chat/completions")
FLUSH_TIMEOUT_MS = 5_000  # what a stopping server waits for its last spans to reach the collector
REQUEST_ID_ATTRIBUTE = "request.id"
TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """The collector's traces URL: ``http://host:4318`` gains OTLP's ``/v1/traces``; a URL that names it is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


class Tracing:
    """A tracer with its own ``TracerProvider`` (a process may send to two collectors), batching spans to ``endpoint``."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        self.endpoint = traces_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))
        self.tracer = self.provider.get_tracer(__name__)
        # The engine times with perf_counter; spans want epoch nanoseconds.
        self._epoch_minus_perf_ns = time.time_ns() - time.perf_counter_ns()

    def epoch_ns(self, perf_s: float) -> int:
        """A ``time.perf_counter()`` reading as the epoch nanoseconds a span's start or end takes."""
        return self._epoch_minus_perf_ns + int(perf_s * 1e9)

    def flush(self, timeout_ms: int = FLUSH_TIMEOUT_MS) -> bool:
        """Export every finished span now (a batch waits for its interval, and a process that ends drops it)."""
        return self.provider.force_flush(timeout_ms)


@functools.cache
def tracing_for(endpoint: str, service_name: str = SERVER_SERVICE) -> Tracing:
    """The process's :class:`Tracing` for ``endpoint`` (one per endpoint and service)."""
    return Tracing(endpoint, service_name)


@dataclass
class RequestTrace:
    """One request's shell span and the context its other spans take as their parent."""

    tracing: Tracing
    span: Any  # opentelemetry.trace.Span
    context: Any  # opentelemetry.context.Context holding ``span``
    state: dict  # the ASGI scope's state, where chapter 7's shell writes the request id it settled on

    @property
    def request_id(self) -> str:
        return self.state["request_id"]

    def child(self, name: str, start_s: float, end_s: float, attributes: dict | None = None, error: str | None = None) -> None:
        """A finished span under the shell, from two ``perf_counter`` readings."""
        span = self.tracing.tracer.start_span(name, context=self.context, start_time=self.tracing.epoch_ns(start_s),
                                              attributes={REQUEST_ID_ATTRIBUTE: self.request_id, **(attributes or {})})
        if error is not None:
            from opentelemetry.trace import Status, StatusCode
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.tracing.epoch_ns(end_s))


current_request_trace: ContextVar[RequestTrace | None] = ContextVar("current_request_trace", default=None)


class TracedRequests:
    """ASGI middleware: a shell span per request to ``paths``, current while the app runs, and its ``answer`` span."""

    span_prefix = ""
    answer_span = True  # chapter 9's edge has none: the replica's shell says when its answer went

    def __init__(self, app, tracing: Tracing, paths: tuple[str, ...] = TRACED_PATHS) -> None:
        self.app, self.tracing, self.paths = app, tracing, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # the app's shutdown (after its drain) waits for the last spans to be exported
            await self.app(scope, receive, self._flush_before_shutdown_completes(send))
            return
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        parent = propagate.extract(headers)  # the caller's span, from W3C traceparent (none: a new trace)
        span = self.tracing.tracer.start_span(f"{self.span_prefix}{scope['method']} {scope['path']}", context=parent,
                                              kind=SpanKind.SERVER, attributes={"http.request.method": scope["method"], "url.path": scope["path"]})
        state = scope.setdefault("state", {})
        # chapter 7's shell replaces it with the id it settles on (the same, for a sane client id)
        state.setdefault("request_id", request_id_from(headers.get(REQUEST_ID_HEADER.lower())))
        request = RequestTrace(self.tracing, span, trace.set_span_in_context(span, parent), state)
        tokens = context.attach(request.context), current_request_trace.set(request)
        answer = _Answer()

        async def traced_send(message: dict) -> None:
            answer.saw(message)
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.record_exception(exc)
            answer.status = answer.status or 500
            raise
        finally:
            current_request_trace.reset(tokens[1])
            context.detach(tokens[0])
            if answer.request_id:
                state["request_id"] = answer.request_id
            if self.answer_span and answer.started is not None:
                request.child("answer", answer.started, answer.ended or time.perf_counter(),
                              {"http.response.status_code": answer.status, "answer.writes": answer.writes, "answer.bytes": answer.bytes})
            span.set_attributes({REQUEST_ID_ATTRIBUTE: request.request_id, "http.response.status_code": answer.status or 500})
            if (answer.status or 500) >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {answer.status or 500}"))
            span.end()

    def _flush_before_shutdown_completes(self, send):
        async def flush_then_send(message: dict) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await asyncio.to_thread(self.tracing.flush)
            await send(message)
        return flush_then_send


@dataclass
class _Answer:
    """What the app sent: status, when the first and the last byte went, how many writes and bytes."""

    status: int | None = None
    started: float | None = None
    ended: float | None = None
    writes: int = 0
    bytes: int = 0
    request_id: str | None = None

    def saw(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status, self.started = message["status"], time.perf_counter()
            # the id the client was given (behind chapter 9's edge: the one the replica's shell settled on)
            self.request_id = next((bytes(v).decode("latin-1") for k, v in message.get("headers") or []
                                   if bytes(k).lower() == REQUEST_ID_HEADER.lower().encode()), None)
        elif message["type"] == "http.response.body":
            self.writes += 1
            self.bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.ended = time.perf_counter()


class TraceIdsInLogLines(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (hex, as Jaeger shows them) to a record written inside a traced request."""

    def __init__(self) -> None:
        super().__init__()
        from opentelemetry import trace
        self.current_span = trace.get_current_span

    def filter(self, record: logging.LogRecord) -> bool:
        context = self.current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True


@functools.cache
def log_trace_ids(logger_name: str) -> None:
    """Records of ``logger_name`` name their trace: a filter on the logger (whatever its handlers), added once per process."""
    logging.getLogger(logger_name).addFilter(TraceIdsInLogLines())
