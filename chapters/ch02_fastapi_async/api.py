"""The HTTP face every async chapter shares: routes, the contract's errors, request ids.

Chapter 2 introduces it; chapters 3 and later import :func:`create_app` and hand it a different
``generate`` coroutine (a batcher, a memory pool, an engine), so their diffs show only what changed
behind the endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.schemas import (
    REQUEST_ID_HEADER,
    STATUS_ERROR_TYPES,
    ApiError,
    ContractLimits,
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


# A backend: given the checked request and a way to ask whether the client is still there.
Generate = Callable[[ValidRequest, Callable[[], Awaitable[bool]]], Awaitable[Generated]]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing early (413) when the declared or the streamed size passes ``limit``."""
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


def create_app(
    *,
    title: str,
    limits: ContractLimits,
    tokenizer: Tokenizer,
    generate: Generate,
    health: Callable[[], dict] = lambda: {},
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The contract's routes around ``generate``; ``health`` adds fields to ``/healthz``."""
    app = FastAPI(title=title, lifespan=lifespan)

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
        return {"status": "ok", **health()}

    @app.post("/v1/inference")
    async def inference(request: Request) -> JSONResponse:
        started = time.perf_counter()
        request_id = _request_id(request)
        body = await read_body(request, limits.max_body_bytes)
        valid = parse_inference_request(body, limits, tokenizer)
        parsed = time.perf_counter()
        result = await generate(valid, request.is_disconnected)
        timings = {"parse": (parsed - started) * 1e3, **result.timings_ms, "total": (time.perf_counter() - started) * 1e3}
        response = build_response(request_id, len(valid.input_ids), result.output_ids, tokenizer, timings)
        return JSONResponse(response.model_dump(), headers={REQUEST_ID_HEADER: request_id})

    return app
