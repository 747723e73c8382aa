"""The HTTP face of chapter 1: Flask routes, the contract's JSON errors, request ids; each handler blocks its worker thread."""

from __future__ import annotations

import time
from collections.abc import Callable

from flask import Flask, g, jsonify, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

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

# A backend: the checked request in; the new ids and where their time went (milliseconds) out.
Generate = Callable[[ValidRequest], tuple[list[int], dict[str, float]]]


def _request_id() -> str:
    """The id of the request being handled: the client's ``X-Request-ID`` when sane, else a fresh one."""
    if "request_id" not in g:
        g.request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
    return g.request_id


def _read_body() -> bytes:
    """The whole body; raises ``RequestEntityTooLarge`` (413) past ``MAX_CONTENT_LENGTH`` (a chunked body: at the limit too).

    Reads to the stream's end: on a chunked body Werkzeug raises only on the read after the limit (one ``read()`` would cut it).
    """
    chunks = []
    while chunk := request.stream.read(64 * 1024):
        chunks.append(chunk)
    return b"".join(chunks)


def _error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> ResponseReturnValue:
    return jsonify(error_body(type_, message)), status, headers or {}


def create_app(
    *,
    title: str,
    limits: ContractLimits,
    tokenizer: Tokenizer,
    generate: Generate,
    health: Callable[[], dict] = lambda: {},
) -> Flask:
    """The contract's routes around ``generate``; ``health`` adds fields to ``/healthz``; every response has ``X-Request-ID``."""
    app = Flask(title)
    # Werkzeug enforces the body limit (see _read_body); _too_large turns its 413 into the contract's JSON error.
    app.config["MAX_CONTENT_LENGTH"] = limits.max_body_bytes

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> ResponseReturnValue:
        # EXERCISE ch01.2 BEGIN "the contract's JSON errors: one handler per kind of failure"
        return _error_response(exc.status, exc.type, exc.message, exc.headers)

    @app.errorhandler(RequestEntityTooLarge)
    def _too_large(exc: RequestEntityTooLarge) -> ResponseReturnValue:
        # EXERCISE ch01.2 BEGIN "the contract's JSON errors: one handler per kind of failure"
        return _error_response(413, "body_too_large", f"request body exceeds the limit of {limits.max_body_bytes} bytes")

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> ResponseReturnValue:
        # EXERCISE ch01.2 BEGIN "the contract's JSON errors: one handler per kind of failure"
        # Keep what the status needs (Allow on a 405) but not Werkzeug's HTML content type.
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        return _error_response(exc.code or 500, STATUS_ERROR_TYPES.get(exc.code, "http_error"), exc.description or exc.name, headers)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> ResponseReturnValue:
        # EXERCISE ch01.2 BEGIN "the contract's JSON errors: one handler per kind of failure"
        app.logger.exception("request %s failed", _request_id())
        return _error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")

    @app.after_request
    def _tag_with_request_id(response):  # runs for error responses too
        response.headers[REQUEST_ID_HEADER] = _request_id()
        return response

    @app.get("/healthz")
    def healthz() -> ResponseReturnValue:
        return jsonify({"status": "ok", **health()})

    @app.post("/v1/inference")
    def inference() -> ResponseReturnValue:
        """Read and check the body, generate, answer with ``timings_ms`` (ms): parse, the backend's stages, total."""
        # EXERCISE ch01.1 BEGIN "the request's life: parse, generate, answer, with its stage timings"
        started = time.perf_counter()
        request_id = _request_id()
        body = _read_body()
        valid = parse_inference_request(body, limits, tokenizer)
        parsed = time.perf_counter()
        output_ids, stage_ms = generate(valid)  # this thread is blocked for the whole generation
        timings = {"parse": (parsed - started) * 1e3, **stage_ms, "total": (time.perf_counter() - started) * 1e3}
        response = build_response(request_id, len(valid.input_ids), output_ids, tokenizer, timings)
        return jsonify(response.model_dump())

    return app
