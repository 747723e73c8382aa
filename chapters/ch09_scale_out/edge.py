"""The contract at the edge: what a client sees when Serve's proxy answers for the replicas, or a replica dies.

:class:`ContractAtTheEdge`, in Serve's proxy (:func:`proxy_middlewares`), turns Serve's plain-text errors into the contract's
JSON (a 503 gains ``Retry-After``); sends a request whose replica ended it before a byte once more (greedy decoding answers the
same) if its body fitted in ``REPLAY_LIMIT_BYTES`` and its client stayed (``X-Attempts: 2``), else answers the JSON 500
``replica_failed`` or ends a cut stream with its error event. Every answer leaves with one ``X-Request-ID``."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from starlette.middleware import Middleware

from chapters.ch08_continuous_batching.streaming import sse
from chapters.ch08_continuous_batching.tracing import OTLP_ENDPOINT_ENV, TracedRequests, Tracing, tracing_for
from chapters.ch09_scale_out.routing import TOKEN_BUDGET_HEADER, token_budget
from chapters.ch09_scale_out.stopping import DrainAtTheEdge
from shared.schemas import error_body

log = logging.getLogger("chapters.ch09_scale_out.edge")
REPLAY_LIMIT_BYTES = 1 << 20  # a request body kept for one replay; the contract's bodies are far smaller
SERVE_ERROR_TYPES = {404: "not_found", 408: "deadline_exceeded", 429: "overloaded", 500: "replica_failed", 503: "unavailable"}
ATTEMPTS_HEADER = b"x-attempts"
REQUEST_ID_HEADER = b"x-request-id"
EDGE_SERVICE = "ch09-edge"
REPLICA_FAILED = "the replica serving this request stopped before it finished (its process ended); retry it"


def proxy_middlewares() -> list[Middleware]:
    """The middlewares around Serve's proxy (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names this), the last outermost:
    the drain (:mod:`~chapters.ch09_scale_out.stopping`) counts a request from arrival to its last byte, its edge span and
    replays included, and exports the edge's spans before it reports itself idle."""
    tracing = edge_tracing()
    return [Middleware(ContractAtTheEdge), *traced_edge(tracing),
            Middleware(DrainAtTheEdge, before_idle=tracing.flush if tracing is not None else None)]


def edge_tracing() -> Tracing | None:
    """The edge's tracing when ``SFS_OTLP_ENDPOINT`` names a collector, else None."""
    endpoint = os.environ.get(OTLP_ENDPOINT_ENV, "")
    return tracing_for(endpoint, EDGE_SERVICE) if endpoint else None


def traced_edge(tracing: Tracing | None) -> list[Middleware]:
    """The edge span and, inside it, its context put on the request (none without ``tracing``)."""
    if tracing is None:
        return []
    return [Middleware(TraceContextToReplica), Middleware(TraceAtTheEdge, tracing=tracing)]


class TraceAtTheEdge(TracedRequests):
    """Chapter 8's request span, as the edge's, in the proxy's process: the replica's span (chapter 8's shell) is its child
    through the ``traceparent`` header, one trace across the two processes, a replay's two attempts under one edge span."""
    span_prefix = "edge "
    answer_span = False


class TraceContextToReplica:
    """ASGI middleware inside the edge span: the request goes on to its replica carrying the span's context."""
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(with_trace_context(scope) if scope["type"] == "http" else scope, receive, send)


def with_trace_context(scope: dict) -> dict:
    """``scope`` with the current span's context as W3C ``traceparent`` (and ``tracestate``) headers, replacing any the client
    sent, for the replica's span to be this one's child; every other header kept, in order; no current span, none added."""
    from opentelemetry import propagate
    # EXERCISE ch09.4 BEGIN "a span's parent across a process: the current trace context into the request's headers"
    carrier: dict[str, str] = {}
    propagate.inject(carrier)  # the configured propagator writes the current context: W3C trace context by default
    names = {name.lower().encode() for name in carrier} | {b"traceparent", b"tracestate"}
    headers = [(k, v) for k, v in scope.get("headers", []) if bytes(k).lower() not in names]
    return {**scope, "headers": [*headers, *((k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items())]}


@dataclass
class _Attempt:
    """What one pass through the proxy sent to the client."""
    started: bool = False
    finished: bool = False
    event_stream: bool = False
    held: dict | None = None  # a plain-text error's start, kept until its body arrives
    held_body: bytearray = field(default_factory=bytearray)


class _ReplayableBody:
    """The request body, read before the proxy routes the request: for its token budget and for a replay."""
    def __init__(self, receive) -> None:
        self.receive = receive
        self.messages: list[dict] = []
        self.size = 0
        self.complete = False
        self.disconnected = False

    async def read(self) -> None:
        """Read up to ``REPLAY_LIMIT_BYTES`` of body; the rest of a larger one streams through unread."""
        while self.size <= REPLAY_LIMIT_BYTES:
            message = await self.receive()
            self.messages.append(message)
            if message["type"] == "http.disconnect":
                self.disconnected = True
                return
            self.size += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = self.size <= REPLAY_LIMIT_BYTES
                return

    @property
    def replayable(self) -> bool:
        return self.complete and not self.disconnected

    @property
    def body(self) -> bytes | None:
        return b"".join(m.get("body", b"") for m in self.messages) if self.complete else None

    def replay(self):
        """A ``receive`` for one attempt: what was read, then the client's own (its disconnect, or the rest)."""
        recorded = list(self.messages)

        async def receive() -> dict:
            if recorded:
                return recorded.pop(0)
            message = await self.receive()
            self.disconnected |= message["type"] == "http.disconnect"
            return message
        return receive


def one_request_id(headers: list) -> list:
    """The answer's headers with one ``X-Request-ID``: the first, the app's own, which its body and log lines name (Serve's
    proxy appends its own, which differs where chapter 7 replaced a client's odd id; Serve's refusals carry only Serve's)."""
    kept, seen = [], False
    for name, value in headers:
        if bytes(name).lower() == REQUEST_ID_HEADER:
            if seen:
                continue
            seen = True
        kept.append((name, value))
    return kept


def with_token_budget(scope: dict, body: bytes | None) -> dict:
    """The scope with the request's token budget in its headers, for the router; a client's own is dropped."""
    headers = [(k, v) for k, v in scope.get("headers", []) if bytes(k).lower() != TOKEN_BUDGET_HEADER]
    budget = token_budget(body) if body is not None else None
    if budget is not None:
        headers.append((TOKEN_BUDGET_HEADER, str(budget).encode()))
    return {**scope, "headers": headers}


class ContractAtTheEdge:
    """Middleware around Serve's proxy: the contract's JSON errors, one replay when a replica died first."""
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = _ReplayableBody(receive)
        await body.read()
        scope = with_token_budget(scope, body.body)
        # EXERCISE ch09.2 BEGIN "the edge: replay a request whose replica died before a byte, else end it with the contract's error"
        attempt = await self._attempt(scope, body.replay(), send, number=1)
        if not attempt.started and body.replayable:
            log.warning("%s %s: the replica ended the request before answering; sending it again", scope["method"], scope["path"])
            attempt = await self._attempt(scope, body.replay(), send, number=2)
        if attempt.finished or body.disconnected:
            return
        if not attempt.started:
            await _send_json(send, 500, error_body("replica_failed", REPLICA_FAILED), [])
        elif attempt.event_stream:
            await send({"type": "http.response.body", "body": _stream_error(scope["path"]), "more_body": False})
        # else: a JSON body cut half-way; ending it would pass off a truncated body as whole

    async def _attempt(self, scope, receive, send, number: int) -> _Attempt:
        attempt = _Attempt()

        async def keep_the_contract(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": one_request_id(message.get("headers") or [])}
                headers = dict(message["headers"])
                content_type = bytes(headers.get(b"content-type", b""))
                if message["status"] >= 400 and content_type.startswith(b"text/plain"):
                    attempt.held = message  # Serve's own refusal: rewritten once its body is here
                    return
                attempt.started = True
                attempt.event_stream = content_type.startswith(b"text/event-stream")
                if number > 1:
                    message = {**message, "headers": [*message.get("headers", []), (ATTEMPTS_HEADER, str(number).encode())]}
            elif message["type"] == "http.response.body":
                if attempt.held is not None:
                    attempt.held_body += message.get("body", b"")
                    if message.get("more_body", False):
                        return
                    attempt.started = attempt.finished = True
                    await _send_serve_error(send, attempt.held, attempt.held_body.decode("utf-8", "replace"))
                    return
                attempt.finished = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, keep_the_contract)
        except Exception:  # the proxy failed before or while answering: the caller answers in its place
            log.exception("%s %s: Serve's proxy failed", scope["method"], scope["path"])
        return attempt


async def _send_serve_error(send, start: dict, text: str) -> None:
    status = start["status"]
    headers = [(k, v) for k, v in start.get("headers") or [] if bytes(k).lower() not in (b"content-type", b"content-length")]
    if status == 503 and not any(bytes(k).lower() == b"retry-after" for k, _ in headers):
        headers.append((b"retry-after", b"1"))
    message = text.strip() or f"Serve answered {status} for the replicas"
    await _send_json(send, status, error_body(SERVE_ERROR_TYPES.get(status, "serve_error"), message), headers)


async def _send_json(send, status: int, body: dict, headers: list) -> None:
    payload = json.dumps(body).encode()
    headers = [*headers, (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _stream_error(path: str) -> bytes:
    """The event that ends a cut stream, in the stream's own dialect."""
    body = error_body("replica_failed", REPLICA_FAILED)
    if path.startswith("/v1/inference"):
        return sse(body, event="error")
    return sse(body)  # the OpenAI routes: the client raises APIError from an "error" payload
