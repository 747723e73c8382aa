"""The HTTP face every async chapter shares: routes, the contract's errors, request ids, and the :class:`Backend` it serves.

Streaming is optional: given a :data:`StreamWriter` for a :class:`StreamingBackend`, ``/v1/inference`` accepts
``"stream": true``; without one, ``stream`` is an unknown field (422).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.schemas import (
    REQUEST_ID_HEADER,
    STATUS_ERROR_TYPES,
    ApiError,
    ContractLimits,
    InferenceRequest,
    InferenceResponse,
    ValidRequest,
    build_response,
    error_body,
    parse_inference_request,
    request_id_from,
)
from shared.tokenizer import Tokenizer


@dataclass
class Generated:
    """What a backend returns for one request: the new ids and where its time went."""

    output_ids: list[int]
    timings_ms: dict[str, float] = field(default_factory=dict)


# Asks whether the client behind a request has gone away (Starlette's ``request.is_disconnected``).
DisconnectCheck = Callable[[], Awaitable[bool]]


class Backend(Protocol):
    """What serves inference behind the HTTP layer.

    ``start`` runs in the server's event loop before the first request, ``close`` after the last (it finishes what was accepted).
    ``generate`` computes one checked request and may raise :class:`~shared.schemas.ApiError` (429, 499, 500, 503, ...), which
    becomes that status. ``health`` adds fields to ``/healthz``; ``stats`` is ``/stats`` (JSON).
    """

    async def start(self) -> None: ...
    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated: ...
    def health(self) -> dict: ...
    def stats(self) -> dict: ...
    async def close(self) -> None: ...


class StreamingBackend(Backend, Protocol):
    """A backend that can also hand out a request's tokens as they are made.

    ``open_stream`` admits the request at once, raising :class:`~shared.schemas.ApiError` as ``generate`` would, and returns
    its tokens one by one, then one :class:`Generated`. Closing the iterator early aborts the request and frees what it held.
    """

    async def open_stream(self, request: ValidRequest) -> AsyncIterator[int | Generated]: ...


@dataclass(frozen=True)
class StreamedRequest:
    """What a stream writer knows of the request it answers."""

    request_id: str
    prompt_len: int
    started: float  # time.perf_counter() when the request arrived
    parsed: float  # time.perf_counter() once the contract's checks passed
    tokenizer: Tokenizer


# Writes a streaming backend's events (tokens, then the Generated) as the HTTP response.
StreamWriter = Callable[[AsyncIterator[int | Generated], StreamedRequest], Response]


@dataclass(frozen=True)
class RequestContract:
    """What ``/v1/inference`` accepts: the body's schema (for the OpenAPI document) and the function that checks a body."""

    schema: type[InferenceRequest]
    parse: Callable[[bytes, ContractLimits, Tokenizer], ValidRequest]


INFERENCE_CONTRACT = RequestContract(InferenceRequest, parse_inference_request)


async def read_body(request: Request, limit: int) -> bytes:
    """The body; a body of exactly ``limit`` bytes is accepted.

    Raises ``ApiError(413, "body_too_large", ...)`` without reading when ``Content-Length`` declares more than ``limit``
    bytes, else as soon as the bytes read so far pass ``limit`` (the rest is never read).
    """
    # EXERCISE ch02.3 BEGIN "the body limit: 413 on the declared size, or as soon as the stream passes it"
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise ApiError(413, "body_too_large", f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _request_id(request: Request) -> str:
    if not hasattr(request.state, "request_id"):
        request.state.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    return request.state.request_id


def _error_response(request: Request, status: int, type_: str, message: str, headers: dict | None = None) -> JSONResponse:
    headers = {**(headers or {}), REQUEST_ID_HEADER: _request_id(request)}
    return JSONResponse(error_body(type_, message), status_code=status, headers=headers)


# What /v1/inference may answer besides 200, as the OpenAPI document declares it (the whole contract, in every chapter).
ERROR_RESPONSES = {
    400: "the body is not JSON",
    413: "the body is larger than the server accepts",
    422: "invalid fields, ids outside the vocabulary, or prompt + new tokens over the context",
    429: "the queue is full: retry after the Retry-After header's seconds",
    499: "the client disconnected before its request was computed",
    500: "the batch this request was computed in failed",
    503: "the server is not ready or is draining",
    504: "the request passed its deadline",
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}


def inference_openapi(streams: bool = False, schema: type[InferenceRequest] = InferenceRequest) -> dict:
    """The request body and every response of ``/v1/inference`` for the OpenAPI document; ``streams``: it takes ``"stream"``.

    The endpoint reads its body by hand (to refuse an oversized one early), so FastAPI cannot infer its schema.
    """
    schema = schema.model_json_schema()
    if streams:
        schema["properties"]["stream"] = {"type": "boolean", "default": False,
                                          "description": "true: the answer is a text/event-stream, one event per token"}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        },
        "responses": {
            str(status): {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for status, text in ERROR_RESPONSES.items()
        },
    }


def take_stream_flag(body: bytes) -> tuple[bytes, bool]:
    """``body`` without its ``stream`` field, and that field (422 unless a bool); a non-object body is left to the parser."""
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return body, False
    if not isinstance(raw, dict) or "stream" not in raw:
        return body, False
    flag = raw.pop("stream")
    if not isinstance(flag, bool):
        raise ApiError(422, "invalid_request", f"stream: must be true or false, got {flag!r}")
    return json.dumps(raw).encode(), flag


def create_app(*, title: str, limits: ContractLimits, tokenizer: Tokenizer, backend: Backend,
               stream_writer: StreamWriter | None = None, contract: RequestContract = INFERENCE_CONTRACT) -> FastAPI:
    """The contract's routes around ``backend``; its ``start``/``close`` bracket the server's life.

    With ``stream_writer`` (``backend`` must then be a :class:`StreamingBackend`; TypeError if not), ``/v1/inference`` also
    accepts ``"stream": true`` and answers with what the writer makes of the stream. ``contract`` checks the body.
    """
    if stream_writer is not None and not hasattr(backend, "open_stream"):
        raise TypeError(f"{type(backend).__name__} does not stream (no open_stream), yet a stream writer was given")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        yield
        # On SIGTERM uvicorn stops accepting and lets in-flight requests finish before we get here.
        await backend.close()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.backend = backend

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(request, exc.status, exc.type, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = STATUS_ERROR_TYPES.get(exc.status_code, "http_error")
        return _error_response(request, exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(request, 500, "internal_error", f"{type(exc).__name__}: {exc}")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", **backend.health()}

    @app.get("/stats")
    async def stats() -> dict:
        return backend.stats()

    @app.post("/v1/inference", response_model=InferenceResponse, openapi_extra=inference_openapi(stream_writer is not None, contract.schema))
    async def inference(request: Request) -> Response:
        started = time.perf_counter()
        request_id = _request_id(request)
        body = await read_body(request, limits.max_body_bytes)
        body, stream_wanted = take_stream_flag(body) if stream_writer is not None else (body, False)
        valid = contract.parse(body, limits, tokenizer)
        parsed = time.perf_counter()
        if stream_wanted:
            tokens = await backend.open_stream(valid)  # admission now: a refusal is still a JSON error
            return stream_writer(tokens, StreamedRequest(request_id, len(valid.input_ids), started, parsed, tokenizer))
        result = await backend.generate(valid, request.is_disconnected)
        timings = {"parse": (parsed - started) * 1e3, **result.timings_ms, "total": (time.perf_counter() - started) * 1e3}
        response = build_response(request_id, len(valid.input_ids), result.output_ids, tokenizer, timings)
        return JSONResponse(response.model_dump(), headers={REQUEST_ID_HEADER: request_id})

    return app
