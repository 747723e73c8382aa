"""Server-sent events for streamed ``/v1/inference``: ``event: token`` per token (``{"token_id": 72, "text": "H"}``), then
``event: done`` with the plain answer's JSON, or ``event: error`` with the error body for a failure after the stream started
(before it: an ordinary JSON error with its status). The texts concatenate to the final text."""

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


def token_event(token_id: int, text: str) -> bytes:
    """``sse({"token_id": token_id, "text": text}, event="token")``, the same bytes, encoding only the string (a C fast path)."""
    return f'event: token\ndata: {{"token_id":{int(token_id)},"text":{json.dumps(text)}}}\n\n'.encode()


class TextDelta:
    """The new text each token adds, never splitting a character (U+FFFD at the end means: not yet). It decodes a window, the
    tokens last handed out (``ids[prefix:read]``, context) and those after, moved on once its text ends in a whole character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # where the window starts: tokens before it are never decoded again
        self.read = 0  # tokens whose text has been handed out
        self.held = ""  # text decoded and held back (it ends in U+FFFD): the handed-out text plus this is the whole decode

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Whatever is still held back, at the end of the stream."""
        return self._advance(hold_incomplete=False)

    def _advance(self, hold_incomplete: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if hold_incomplete and text.endswith("\ufffd"):
            self.held = text[len(before):]
            return ""  # probably an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read, self.held = self.read, len(self.ids), ""
        return text[len(before):]


class EventRuns:
    """A stream's events grouped into writes: the first alone, then ``stream_interval`` per write, the rest with the last."""

    def __init__(self, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.held: list[bytes] = []
        self.started = False

    def add(self, event: bytes) -> bytes | None:
        """The bytes to write now (this event and those held before it), or None: hold it."""
        self.held.append(event)
        if self.started and len(self.held) < self.stream_interval:
            return None
        self.started = True
        return self.rest()

    def rest(self, last: bytes = b"") -> bytes:
        """Everything held, then ``last``; nothing is held after."""
        out, self.held = b"".join(self.held) + last, []
        return out


def write_sse_stream(tokens: AsyncIterator[int | Generated], request: StreamedRequest, stream_interval: int = 1) -> StreamingResponse:
    """Chapter 2's ``StreamWriter`` for ``/v1/inference``: ``token`` events, ``done`` or ``error``, in :class:`EventRuns`."""
    return StreamingResponse(_inference_events(tokens, request, stream_interval), media_type="text/event-stream",
                             headers={**SSE_HEADERS, REQUEST_ID_HEADER: request.request_id})


async def _inference_events(tokens: AsyncIterator[int | Generated], request: StreamedRequest,
                            stream_interval: int = 1) -> AsyncIterator[bytes]:
    text, runs = TextDelta(request.tokenizer), EventRuns(stream_interval)
    try:
        async for event in tokens:
            if not isinstance(event, Generated):
                if (due := runs.add(token_event(event, text.add(event)))) is not None:
                    yield due
                continue
            timings = {"parse": (request.parsed - request.started) * 1e3, **event.timings_ms,
                       "total": (time.perf_counter() - request.started) * 1e3}
            answer = build_response(request.request_id, request.prompt_len, event.output_ids, request.tokenizer, timings)
            yield runs.rest(sse(answer.model_dump(), event="done"))
    except ApiError as error:  # after the stream started: the status line is gone, the error is an event
        yield runs.rest(sse(error.body(), event="error"))
    finally:
        await tokens.aclose()  # however it ended (the client gone: Starlette cancelled us), stop the sequence
