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
of a word piece: :class:`TextDelta` holds back a trailing incomplete character, so the concatenated
deltas equal the final text (a character still incomplete when the answer ends is in the ``done``
event's text only), and it decodes only the few tokens since the last complete character, so a
token's text costs the same at the thousandth token as at the first.

Every event is its own write on the event loop (the shell's, Starlette's and uvicorn's layers and
one socket write), and streamed answers pay that per token. ``stream_interval`` N above 1 (vLLM's
and SGLang's ``--stream-interval``) keeps the events, one per token, and groups them into writes
(:class:`EventRuns`): the first token's event at once, then N events per write, the rest with the
last. The client reads the same events, in bursts.
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


def token_event(token_id: int, text: str) -> bytes:
    """``sse({"token_id": token_id, "text": text}, event="token")``, the same bytes, from a template.

    The one event sent per token per stream, on the event loop that every request shares:
    ``json.dumps`` of a dict builds an encoder per call, while a string alone takes its C fast path.
    """
    return f'event: token\ndata: {{"token_id":{int(token_id)},"text":{json.dumps(text)}}}\n\n'.encode()


class TextDelta:
    """The new text each token adds, never splitting a character (U+FFFD at the end means: not yet).

    Decoding the whole answer again for every token would cost time growing with the answer (and a
    whole answer's worth, quadratic); like vLLM's incremental detokenizer, this decodes a window:
    the tokens whose text was handed out last (``ids[prefix:read]``, context for tokenizers whose
    pieces read differently after others) and those after them. The new text is what the window
    adds to its first part. The window moves on only when its text ends in a whole character, so
    the decoder starts every window clean.
    """

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
    """A stream's token events grouped into writes: the first alone, then ``stream_interval`` per write.

    The step thread hands a sequence's tokens to the loop in the same runs
    (:class:`~chapters.ch08_continuous_batching.request_stream.StreamListener`), so a write goes out as
    soon as the run that completes it arrives. Whatever is held goes out with the stream's last event.
    """

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
    """Chapter 2's :data:`~chapters.ch02_fastapi_async.api.StreamWriter` for ``/v1/inference``: the
    backend's events as server-sent events (``token`` per token, then ``done`` or ``error``), written
    in runs of ``stream_interval`` after the first (:class:`EventRuns`)."""
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
