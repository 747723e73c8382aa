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

from fastapi.responses import StreamingResponse

from chapters.ch02_fastapi_async.api import Generated, StreamedRequest
from shared.schemas import REQUEST_ID_HEADER, ApiError, build_response
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


def write_sse_stream(tokens: AsyncIterator[int | Generated], request: StreamedRequest) -> StreamingResponse:
    """Chapter 2's :data:`~chapters.ch02_fastapi_async.api.StreamWriter` for ``/v1/inference``: the
    backend's events as server-sent events (``token`` per token, then ``done`` or ``error``)."""
    return StreamingResponse(_inference_events(tokens, request), media_type="text/event-stream",
                             headers={**SSE_HEADERS, REQUEST_ID_HEADER: request.request_id})


async def _inference_events(tokens: AsyncIterator[int | Generated], request: StreamedRequest) -> AsyncIterator[bytes]:
    text = TextDelta(request.tokenizer)
    try:
        async for event in tokens:
            if not isinstance(event, Generated):
                yield sse({"token_id": event, "text": text.add(event)}, event="token")
                continue
            timings = {"parse": (request.parsed - request.started) * 1e3, **event.timings_ms,
                       "total": (time.perf_counter() - request.started) * 1e3}
            answer = build_response(request.request_id, request.prompt_len, event.output_ids, request.tokenizer, timings)
            yield sse(answer.model_dump(), event="done")
    except ApiError as error:  # after the stream started: the status line is gone, the error is an event
        yield sse(error.body(), event="error")
    finally:
        await tokens.aclose()  # however it ended (the client gone: Starlette cancelled us), stop the sequence
