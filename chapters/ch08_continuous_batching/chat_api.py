"""OpenAI's chat route, ``POST /v1/chat/completions``: ``messages`` in (written with the model's chat template; none: 400),
the assistant's turn out. It ends at the end-of-turn token (counted in ``usage``, never shown), a ``stop`` string, or
``max_completion_tokens``/``max_tokens`` (neither: what the context leaves); the rest is :mod:`.openai_api`'s, in chat shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from chapters.ch02_fastapi_async.api import Generated, read_body
from chapters.ch08_continuous_batching.continuous_backend import Completion, submitted_sequence
from chapters.ch08_continuous_batching.openai_api import StreamOptions, checked_body, usage
from chapters.ch08_continuous_batching.request_stream import SampledToken
from chapters.ch08_continuous_batching.sampled_contract import SampledRequest
from chapters.ch08_continuous_batching.sampling import MAX_LOGPROBS, MAX_TEMPERATURE, SamplingParams, TokenLogprobs
from chapters.ch08_continuous_batching.stop_strings import EndOfTurn, ShownTokens, StopStrings, StopText, visible_text
from chapters.ch08_continuous_batching.streaming import SSE_HEADERS, EventRuns, sse
from shared.chat_template import ChatTemplateError, chat_prompt
from shared.schemas import ApiError, ContractLimits, check_limits
from shared.tokenizer import Tokenizer


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: StrictStr | None = None
    # OpenAI's fields this server does not implement: only their neutral value is accepted.
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """The first field set to a value this server does not implement, with what it accepts."""
        neutral = {"n": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}
        for name, accepted in neutral.items():
            if getattr(self, name) not in accepted:
                return f"{name}: this server supports only {' or '.join(repr(a) for a in accepted if a is not None)}"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs: needs logprobs set to true"
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            return "max_tokens and max_completion_tokens differ: send one"
        return None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature or 0.0, top_k=self.top_k or 0,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                              logprobs=(self.top_logprobs or 0) if self.logprobs else None)


class ChatApi:
    """The chat route over any backend with chapter 2's ``generate`` and an ``open_stream``."""

    def __init__(self, backend, tokenizer: Tokenizer, limits: ContractLimits, model_name: str, stream_interval: int = 1) -> None:
        self.backend, self.tokenizer, self.limits, self.model_name = backend, tokenizer, limits, model_name
        self.stream_interval = stream_interval
        self.end_of_turn = frozenset({tokenizer.eos_id})

    def register(self, app: FastAPI) -> None:
        app.post("/v1/chat/completions")(self.chat)

    def parse(self, body: bytes) -> tuple[ChatRequest, SampledRequest]:
        chat = checked_body(ChatRequest, body, self.model_name)
        try:
            prompt = chat_prompt(self.tokenizer, [{"role": m.role, "content": m.text()} for m in chat.messages])
            strings = StopStrings(chat.stops(), self.tokenizer) if chat.stops() else None
        except ChatTemplateError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        except ValueError as exc:
            raise ApiError(422, "invalid_request", f"stop: {exc}") from None
        ids = self.tokenizer.encode(prompt)
        room = min(self.limits.max_new_tokens, self.limits.n_ctx - len(ids))
        asked = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
        max_tokens = asked if asked is not None else max(room, 1)
        checked = check_limits(ids, max_tokens, self.limits)
        return chat, SampledRequest(checked, max_tokens, sampling=chat.sampling(), stop=EndOfTurn(self.end_of_turn, strings))

    async def chat(self, request: Request):
        body = await read_body(request, self.limits.max_body_bytes)
        chat, valid = self.parse(body)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if chat.stream:
            include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
            tokens = await self.backend.open_stream(valid)  # admission now: a refusal is still a JSON error
            return StreamingResponse(self._chunks(tokens, meta, len(valid.input_ids), include_usage, chat.stops()),
                                     media_type="text/event-stream", headers={**SSE_HEADERS, **sequence_header()})
        result = await self.backend.generate(valid, request.is_disconnected)
        answer = self.answer_ids(result.output_ids)
        content = visible_text(self.tokenizer, answer, chat.stops())
        logprobs = result.logprobs if isinstance(result, Completion) else None
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "logprobs": self._logprobs(answer, logprobs, content) if logprobs is not None else None,
                  "finish_reason": _finish_reason(result)}
        return JSONResponse({**meta, "object": "chat.completion", "choices": [choice],
                             "usage": usage(len(valid.input_ids), len(result.output_ids))}, headers=sequence_header())

    def answer_ids(self, output_ids: list[int]) -> list[int]:
        """The tokens whose text is the turn: all but a closing end-of-turn token (only the last can be one)."""
        return output_ids[:-1] if output_ids and output_ids[-1] in self.end_of_turn else output_ids

    def _logprobs(self, answer: list[int], logprobs: list[TokenLogprobs], content: str) -> dict:
        """The chat shape of ``logprobs``: an entry per token of the turn whose text starts before a stop string's cut."""
        cut = len(content) if content != self.tokenizer.decode(answer) else None
        text, entries = StopText(self.tokenizer), []
        for token, entry in zip(answer, logprobs):
            if cut is not None and text.decoded_chars >= cut:
                break
            text.add(token)
            entries.append(self._entry(token, entry))
        return {"content": entries}

    def _entry(self, token: int, entry: TokenLogprobs) -> dict:
        piece = lambda t: self.tokenizer.decode([t])  # noqa: E731
        return {"token": piece(token), "logprob": entry.logprob, "bytes": list(piece(token).encode()),
                "top_logprobs": [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode())} for t, lp in entry.top]}

    async def _chunks(self, tokens: AsyncIterator[int | Generated], meta: dict, prompt_tokens: int, include_usage: bool,
                      stops: tuple[str, ...]) -> AsyncIterator[bytes]:
        text, runs = StopText(self.tokenizer, stops), EventRuns(self.stream_interval)
        shown = ShownTokens(text)  # a token's log-probabilities go out with its text, never for a stop's tokens
        chunk = lambda delta, reason=None, entries=None: sse({  # noqa: E731
            **meta, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": {"content": entries} if entries else None, "finish_reason": reason}]})
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for event in tokens:
                if isinstance(event, Generated):
                    rest, released = shown.finish()
                    last = (chunk({"content": rest}, None, released) if rest or released else b"") + chunk({}, _finish_reason(event))
                    if include_usage:
                        last += sse({**meta, "object": "chat.completion.chunk", "choices": [],
                                     "usage": usage(prompt_tokens, len(event.output_ids))})
                    yield runs.rest(last + sse("[DONE]"))
                    return
                if event in self.end_of_turn:
                    continue  # the turn's end: counted in usage, never shown
                entry = self._entry(int(event), event.logprobs) if isinstance(event, SampledToken) else None
                piece, released = shown.add(event, entry)
                released = [e for e in released if e is not None]
                if not (piece or released):
                    continue  # held back (it may start a stop) or removed by one: nothing to send yet
                due = runs.add(chunk({"content": piece}, None, released))
                if due is not None:
                    yield due
        except ApiError as error:
            yield runs.rest(sse(error.body()))  # the client raises APIError from an "error" payload
        finally:
            await tokens.aclose()


def sequence_header() -> dict[str, str]:
    """``X-Sequence-Id``: the id the step view (``/ui/``, ``/stats``) gives this request's sequence, where it ran in this task."""
    seq_id = submitted_sequence.get()
    return {"X-Sequence-Id": str(seq_id)} if seq_id is not None else {}


def _finish_reason(result: Generated) -> str:
    return result.finish_reason if isinstance(result, Completion) else "length"
