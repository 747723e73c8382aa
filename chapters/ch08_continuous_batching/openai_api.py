"""An OpenAI-compatible face: ``POST /v1/completions`` and ``GET /v1/models``, so the official client works unchanged.

``temperature`` 0 or absent is greedy, ``top_k`` 0 no limit; ``stop`` ends the text before the first one found (``finish_reason``
"stop", else "length"); ``logprobs`` cover the text shown, ``usage`` every token generated. A stream ends with ``data: [DONE]``.
An unknown field, or a value not implemented here: 422; another ``model``: 404; error body ``{"error": {"type", "message"}}``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from chapters.ch02_fastapi_async.api import Generated, read_body
from chapters.ch08_continuous_batching.continuous_backend import Completion
from chapters.ch08_continuous_batching.sampled_contract import SampledRequest
from chapters.ch08_continuous_batching.sampling import MAX_LOGPROBS, MAX_TEMPERATURE, SamplingParams, TokenLogprobs
from chapters.ch08_continuous_batching.request_stream import SampledToken
from chapters.ch08_continuous_batching.stop_strings import ShownTokens, StopStrings, StopText, visible_text
from chapters.ch08_continuous_batching.streaming import SSE_HEADERS, EventRuns, sse
from shared.schemas import ApiError, ContractLimits, check_limits
from shared.tokenizer import Tokenizer


RequestT = TypeVar("RequestT", bound=BaseModel)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    prompt: StrictStr | list[StrictInt]
    max_tokens: StrictInt = 16
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: StrictStr | None = None
    # OpenAI's fields this server does not implement: only their neutral value is accepted.
    n: StrictInt | None = None
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> str | None:
        """The first field set to a value this server does not implement, with what it accepts."""
        neutral = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "presence_penalty": (None, 0),
                   "frequency_penalty": (None, 0), "logit_bias": (None, {}), "suffix": (None,)}
        for name, accepted in neutral.items():
            if getattr(self, name) not in accepted:
                return f"{name}: this server supports only {' or '.join(repr(a) for a in accepted if a is not None) or 'absent'}"
        return None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature or 0.0, top_k=self.top_k or 0,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed, logprobs=self.logprobs)


class CompletionsApi:
    """The two routes, over any backend with chapter 2's ``generate`` and an ``open_stream``."""

    def __init__(self, backend, tokenizer: Tokenizer, limits: ContractLimits, model_name: str, stream_interval: int = 1) -> None:
        self.backend, self.tokenizer, self.limits, self.model_name = backend, tokenizer, limits, model_name
        self.stream_interval = stream_interval  # chunks per write after the first (streaming.EventRuns)

    def register(self, app: FastAPI) -> None:
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "serving-from-scratch"}]}

    def parse(self, body: bytes) -> tuple[CompletionRequest, SampledRequest]:
        request = checked_body(CompletionRequest, body, self.model_name, _one_prompt)
        try:
            stop = StopStrings(request.stops(), self.tokenizer) if request.stops() else None
        except ValueError as exc:
            raise ApiError(422, "invalid_request", f"stop: {exc}") from None
        if isinstance(request.prompt, str):
            try:
                ids = self.tokenizer.encode(request.prompt)
            except ValueError as exc:
                raise ApiError(422, "invalid_request", str(exc)) from None
        else:
            ids = request.prompt
        if not 1 <= request.max_tokens <= self.limits.max_new_tokens:
            raise ApiError(422, "invalid_request", f"max_tokens must be between 1 and {self.limits.max_new_tokens}, got {request.max_tokens}")
        checked = check_limits(ids, request.max_tokens, self.limits)
        return request, SampledRequest(checked, request.max_tokens, sampling=request.sampling(), stop=stop)

    async def completions(self, request: Request):
        body = await read_body(request, self.limits.max_body_bytes)
        completion, valid = self.parse(body)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if completion.stream:
            include_usage = bool(completion.stream_options and completion.stream_options.include_usage)
            tokens = await self.backend.open_stream(valid)  # admission now: a refusal is still a JSON error
            return StreamingResponse(
                self._chunks(tokens, meta, len(valid.input_ids), include_usage, completion.stops()),
                media_type="text/event-stream", headers=SSE_HEADERS,
            )
        result = await self.backend.generate(valid, request.is_disconnected)
        logprobs = result.logprobs if isinstance(result, Completion) else None
        text = visible_text(self.tokenizer, result.output_ids, completion.stops())
        return JSONResponse({
            **meta,
            "choices": [_choice(text, _finish_reason(result),
                                self._shown_logprobs(result.output_ids, logprobs, text) if logprobs is not None else None)],
            "usage": usage(len(valid.input_ids), len(result.output_ids)),
        })

    def _shown_logprobs(self, output_ids: list[int], logprobs: list[TokenLogprobs], text: str) -> dict:
        """:meth:`_logprobs` of the tokens whose text starts within ``text``, the answer as a stop string may have cut it."""
        offsets = self._text_offsets(output_ids)
        cut = len(text) if text != self.tokenizer.decode(output_ids) else None
        shown = len(output_ids) if cut is None else sum(1 for offset in offsets if offset < cut)
        return self._logprobs(output_ids[:shown], logprobs[:shown], offsets[:shown])

    def _logprobs(self, output_ids: list[int], logprobs: list[TokenLogprobs], text_offsets: list[int]) -> dict:
        """OpenAI's completions ``logprobs`` for ``output_ids``; ``text_offsets``: where each token's text starts (characters)."""
        decode = self.tokenizer.decode
        return {
            "tokens": [decode([token]) for token in output_ids],
            "token_logprobs": [entry.logprob for entry in logprobs],
            "top_logprobs": [{decode([t]): lp for t, lp in entry.top} for entry in logprobs],
            "text_offset": text_offsets,
        }

    def _released(self, released: list[tuple[int, TokenLogprobs, int]]) -> dict | None:
        """The ``logprobs`` of a stream's chunk: the (token, log-probabilities, offset) its text released, or None."""
        if not released:
            return None
        tokens, logprobs, offsets = zip(*released)
        return self._logprobs(list(tokens), list(logprobs), list(offsets))

    def _text_offsets(self, output_ids: list[int]) -> list[int]:
        """Where each token's text starts in the answer's, counted incrementally as a stream counts them."""
        text, offsets = StopText(self.tokenizer), []
        for token in output_ids:
            offsets.append(text.decoded_chars)
            text.add(token)
        return offsets

    async def _chunks(self, tokens: AsyncIterator[int | Generated], meta: dict, prompt_tokens: int, include_usage: bool,
                      stops: tuple[str, ...]) -> AsyncIterator[bytes]:
        text, runs, chunk = StopText(self.tokenizer, stops), EventRuns(self.stream_interval), text_chunk(meta)
        shown = ShownTokens(text)  # a token's log-probabilities go out with its text, never for a stop's tokens
        try:
            async for event in tokens:
                if not isinstance(event, Generated):
                    if isinstance(event, SampledToken):
                        piece, released = shown.add(event, (int(event), event.logprobs, text.decoded_chars))
                        if not (piece or released):
                            continue  # held back (it may start a stop) or removed by one: nothing to send yet
                        due = runs.add(sse({**meta, "choices": [_choice(piece, None, self._released(released))]}))
                    else:
                        due = runs.add(chunk(text.add(event)))
                    if due is not None:
                        yield due
                    continue
                rest, released = shown.finish()
                last = sse({**meta, "choices": [_choice(rest, _finish_reason(event), self._released(released))]})
                if include_usage:
                    last += sse({**meta, "choices": [], "usage": usage(prompt_tokens, len(event.output_ids))})
                yield runs.rest(last + sse("[DONE]"))
        except ApiError as error:
            yield runs.rest(sse(error.body()))  # the client raises APIError from an "error" payload
        finally:
            await tokens.aclose()


def checked_body(model: type[RequestT], body: bytes, served: str,
                 explain: Callable[[list[dict]], str | None] = lambda errors: None) -> RequestT:
    """``body`` as ``model``: 400 for JSON that does not parse, 422 naming each wrong field (or ``explain``'s sentence for
    the errors), 404 for a model not served here, 422 for a field set to a value this server does not implement."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise ApiError(400, "invalid_json", "request body is not valid JSON") from None
        where = explain(exc.errors()) or "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors(include_url=False))
        raise ApiError(422, "invalid_request", where) from None
    if request.model != served:
        raise ApiError(404, "model_not_found", f"model {request.model!r} is not served here; GET /v1/models lists {served!r}")
    refused = request.unsupported()
    if refused is not None:
        raise ApiError(422, "invalid_request", refused)
    return request


def _one_prompt(errors: list[dict]) -> str | None:
    """One sentence for a ``prompt`` of the wrong shape (pydantic reports each member of the union it tried)."""
    if any(e["loc"][:1] == ("prompt",) for e in errors):
        return "prompt: one string or one list of token ids (a list of prompts is not supported: send one request each)"
    return None


def text_chunk(meta: dict) -> Callable[[str], bytes]:
    """``text -> sse({**meta, "choices": [_choice(text, None)]})``, the same bytes from a template: only the text is encoded."""
    head, tail = sse({**meta, "choices": [_choice("\0", None)]}).rsplit(b'"\\u0000"', 1)  # the text is the last field's
    return lambda text: b"".join((head, json.dumps(text).encode(), tail))


def _choice(text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}


def _finish_reason(result: Generated) -> str:
    return result.finish_reason if isinstance(result, Completion) else "length"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
