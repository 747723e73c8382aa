"""Server-sent events: one event per token, as the engine produces them.

The wire format (``text/event-stream``, the WHATWG HTML standard's) is lines of ``field: value``
ending with a blank line. The project's ``/v1/inference`` with ``"stream": true`` sends

    event: token            one per generated token
    data: {"token_id": 72, "text": "H"}

    event: done             last: the same JSON as the non-streaming answer
    data: {"request_id": ..., "output_ids": [...], "text": ..., "usage": {...}, "timings_ms": {...}}

or, if the request ends badly after the stream started (deadline, failed step), ``event: error``
with the contract's error body. Errors found before the first byte (invalid fields, 429) are
ordinary JSON answers with their status: an HTTP status can only be sent before the stream starts.

Text arrives token by token, but a token may be part of a UTF-8 character (the byte tokenizer) or
of a word piece: :class:`TextDelta` decodes everything so far and holds back a trailing incomplete
character, so the concatenated deltas equal the final text.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from chapters.ch02_fastapi_async.api import Generated, inference_openapi, read_body
from shared.schemas import (
    REQUEST_ID_HEADER,
    ApiError,
    ContractLimits,
    InferenceResponse,
    build_response,
    parse_inference_request,
    request_id_from,
)
from shared.tokenizer import Tokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


class TextDelta:
    """The new text each token adds, never splitting a character (U+FFFD at the end means: not yet)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # probably an incomplete UTF-8 sequence: wait for the next token
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def flush(self) -> str:
        """Whatever is still held back, at the end of the stream."""
        text = self.tokenizer.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta


def add_streaming_inference(app: FastAPI, tokenizer: Tokenizer, limits: ContractLimits) -> None:
    """Replace chapter 2's ``/v1/inference`` with one that also accepts ``"stream": true`` (server-sent events).

    Chapter 2's route parses the body itself and refuses unknown fields, so ``stream`` cannot pass
    through it: this route takes ``stream`` out, then checks the rest with the same contract code.
    Without ``stream`` (or with ``false``) it is chapter 2's route: ``backend.generate``, the same
    JSON. With it, ``backend.open_stream`` (the app's backend must offer it).
    """
    backend = app.state.backend
    app.router.routes[:] = [r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path == "/v1/inference")]
    openapi = inference_openapi()
    openapi["requestBody"]["content"]["application/json"]["schema"]["properties"]["stream"] = {"type": "boolean", "default": False}

    @app.post("/v1/inference", response_model=InferenceResponse, openapi_extra=openapi)
    async def inference(request: Request):
        started = time.perf_counter()
        request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        request.state.request_id = request_id
        body = await read_body(request, limits.max_body_bytes)
        body, stream_wanted = _take_stream_flag(body)
        valid = parse_inference_request(body, limits, tokenizer)
        parsed = time.perf_counter()
        headers = {REQUEST_ID_HEADER: request_id}
        if stream_wanted:
            tokens = await backend.open_stream(valid)  # admission now: a refusal is still a JSON error
            events = _inference_events(tokens, tokenizer, request_id, len(valid.input_ids), started, parsed)
            return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        result = await backend.generate(valid, request.is_disconnected)
        timings = {"parse": (parsed - started) * 1e3, **result.timings_ms, "total": (time.perf_counter() - started) * 1e3}
        response = build_response(request_id, len(valid.input_ids), result.output_ids, tokenizer, timings)
        return JSONResponse(response.model_dump(), headers=headers)


def _take_stream_flag(body: bytes) -> tuple[bytes, bool]:
    """``body`` without its ``stream`` field, and that field; invalid JSON is left for the contract's parser (400)."""
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


async def _inference_events(
    tokens: AsyncIterator[int | Generated], tokenizer: Tokenizer, request_id: str, prompt_len: int, started: float, parsed: float
) -> AsyncIterator[bytes]:
    text = TextDelta(tokenizer)
    try:
        async for event in tokens:
            if not isinstance(event, Generated):
                yield sse({"token_id": event, "text": text.add(event)}, event="token")
                continue
            timings = {"parse": (parsed - started) * 1e3, **event.timings_ms, "total": (time.perf_counter() - started) * 1e3}
            yield sse(build_response(request_id, prompt_len, event.output_ids, tokenizer, timings).model_dump(), event="done")
    except ApiError as error:  # after the stream started: the status line is gone, the error is an event
        yield sse(error.body(), event="error")
    finally:
        await tokens.aclose()  # however it ended (the client gone: Starlette cancelled us), stop the sequence
