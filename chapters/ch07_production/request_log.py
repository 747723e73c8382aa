"""One structured JSON log line per request, and the per-request context the backend fills in.

:class:`RequestObserver` wraps each ``POST`` under ``/v1/``: it gives the request its id (the client's ``X-Request-ID``
when sane, else a fresh one, echoed in every answer), opens the :class:`RequestContext` the backend fills in, and once the
response is sent records the metrics and logs one JSON line, lengths only: never the prompt or the output.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

from pythonjsonlogger.json import JsonFormatter

from chapters.ch07_production.metrics import RequestMetrics
from shared.schemas import REQUEST_ID_HEADER, request_id_from

REQUEST_LOG = "chapters.ch07_production.requests"
GENERATING_PREFIX = "/v1/"  # a POST here asks for tokens: /v1/inference, /v1/completions, /v1/chat/completions


@dataclass
class RequestContext:
    request_id: str
    headers: dict[str, str]  # lower-case names
    started: float = field(default_factory=time.perf_counter)
    model_version: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    backend_done: float | None = None  # perf_counter when the backend returned: postprocess starts here
    memory: dict[str, dict[str, int]] | None = None  # stage -> bytes in use then (--memory-snapshots)


current_request: ContextVar[RequestContext | None] = ContextVar("current_request", default=None)


def configure_json_logging(level: str = "info") -> None:
    """Every log record of the process as one JSON object per line on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter("{asctime}{levelname}{name}{message}", style="{", rename_fields={"levelname": "level"}))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


class RequestObserver:
    """ASGI middleware: request id, context, metrics and the request's log line for each route that generates."""

    def __init__(self, app, metrics: RequestMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.log = logging.getLogger(REQUEST_LOG)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith(GENERATING_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        context = RequestContext(request_id_from(headers.get(REQUEST_ID_HEADER.lower())), headers)
        # create_app reads the id from request.state, which Starlette keeps in scope["state"]
        scope.setdefault("state", {})["request_id"] = context.request_id
        token = current_request.set(context)
        status, error_body = 500, bytearray()

        async def observe_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _with_request_id(message, context.request_id)
            elif message["type"] == "http.response.body" and status >= 400:
                error_body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, observe_send)
        finally:
            current_request.reset(token)
            self._record(context, status, _error_type(error_body))

    def _record(self, context: RequestContext, status: int, error_type: str | None) -> None:
        finished = time.perf_counter()
        stages = dict(context.timings_ms)
        if context.backend_done is not None:
            stages["postprocess"] = (finished - context.backend_done) * 1e3
        total_s = finished - context.started
        self.metrics.observe(status, total_s, error_type, stages, context.output_tokens, context.input_tokens)
        self.log.info("request", extra={
            "request_id": context.request_id,
            "model_version": context.model_version,
            "status": status,
            "error_type": error_type,
            "input_tokens": context.input_tokens,
            "output_tokens": context.output_tokens,
            "latency_ms": round(total_s * 1e3, 3),
            "stages_ms": {k: round(v, 3) for k, v in stages.items()},
            **({"memory": context.memory} if context.memory is not None else {}),
        })


def _with_request_id(start: dict, request_id: str) -> dict:
    """The response's start with ``X-Request-ID``, unless the route already set it."""
    headers = list(start.get("headers") or [])
    if any(bytes(name).lower() == REQUEST_ID_HEADER.lower().encode() for name, _ in headers):
        return start
    return {**start, "headers": [*headers, (REQUEST_ID_HEADER.lower().encode(), request_id.encode("latin-1"))]}


def _error_type(body: bytes) -> str | None:
    if not body:
        return None
    try:
        return json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "unparsable_error"
