"""An OpenAI-compatible face: ``POST /v1/completions`` and ``GET /v1/models``, so the official client works unchanged.

What is supported, and what is refused with a clear 422 instead of being silently ignored:

- ``prompt``: a string, or a list of token ids (one prompt per request: lists of prompts are refused);
- ``max_tokens`` (default 16, as OpenAI's); the prompt plus ``max_tokens`` must fit the context;
- ``stream``: server-sent events, one ``text_completion`` chunk per token, then ``data: [DONE]``;
  ``stream_options.include_usage`` adds a last chunk with ``usage``;
- ``temperature``: 0 or absent. This server decodes greedily (every chapter's promise: the oracle's
  tokens); sampling would be a different contract, so any other value is refused. ``top_p`` 1, ``n`` 1.

``model`` must name the served model (``GET /v1/models`` lists it), else 404 as OpenAI answers.
Errors keep the contract's body ``{"error": {"type", "message"}}``: the OpenAI client reads
``error.message`` from it and raises by status (``UnprocessableEntityError`` for 422,
``RateLimitError`` for 429, ...).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from chapters.ch02_fastapi_async.api import Generated, read_body
from chapters.ch08_continuous_batching.streaming import SSE_HEADERS, TextDelta, sse
from shared.schemas import ApiError, ContractLimits, ValidRequest, check_limits
from shared.tokenizer import Tokenizer


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
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = None
    seed: StrictInt | None = None  # accepted and ignored: greedy decoding has nothing to seed
    user: StrictStr | None = None


class CompletionsApi:
    """The two routes, over any backend with chapter 2's ``generate`` and an ``open_stream``."""

    def __init__(self, backend, tokenizer: Tokenizer, limits: ContractLimits, model_name: str) -> None:
        self.backend, self.tokenizer, self.limits, self.model_name = backend, tokenizer, limits, model_name

    def register(self, app: FastAPI) -> None:
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "serving-from-scratch"}]}

    def parse(self, body: bytes) -> tuple[CompletionRequest, ValidRequest]:
        try:
            request = CompletionRequest.model_validate_json(body)
        except ValidationError as exc:
            if any(e["type"] == "json_invalid" for e in exc.errors()):
                raise ApiError(400, "invalid_json", "request body is not valid JSON") from None
            where = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors(include_url=False))
            raise ApiError(422, "invalid_request", where) from None
        if request.model != self.model_name:
            raise ApiError(404, "model_not_found", f"model {request.model!r} is not served here; GET /v1/models lists {self.model_name!r}")
        if request.temperature not in (None, 0, 0.0):
            raise ApiError(422, "invalid_request", f"temperature must be 0 or absent: this server decodes greedily (got {request.temperature})")
        if request.top_p not in (None, 1, 1.0):
            raise ApiError(422, "invalid_request", f"top_p must be 1 or absent: this server decodes greedily (got {request.top_p})")
        if request.n not in (None, 1):
            raise ApiError(422, "invalid_request", f"n must be 1: one completion per request (got {request.n})")
        if isinstance(request.prompt, str):
            try:
                ids = self.tokenizer.encode(request.prompt)
            except ValueError as exc:
                raise ApiError(422, "invalid_request", str(exc)) from None
        else:
            ids = request.prompt
        if not 1 <= request.max_tokens <= self.limits.max_new_tokens:
            raise ApiError(422, "invalid_request", f"max_tokens must be between 1 and {self.limits.max_new_tokens}, got {request.max_tokens}")
        return request, ValidRequest(check_limits(ids, request.max_tokens, self.limits), request.max_tokens)

    async def completions(self, request: Request):
        body = await read_body(request, self.limits.max_body_bytes)
        completion, valid = self.parse(body)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if completion.stream:
            include_usage = bool(completion.stream_options and completion.stream_options.include_usage)
            tokens = await self.backend.open_stream(valid)  # admission now: a refusal is still a JSON error
            return StreamingResponse(
                self._chunks(tokens, meta, len(valid.input_ids), include_usage), media_type="text/event-stream", headers=SSE_HEADERS
            )
        result = await self.backend.generate(valid, request.is_disconnected)
        return JSONResponse({
            **meta,
            "choices": [{"text": self.tokenizer.decode(result.output_ids), "index": 0, "logprobs": None, "finish_reason": "length"}],
            "usage": _usage(len(valid.input_ids), len(result.output_ids)),
        })

    async def _chunks(self, tokens: AsyncIterator[int | Generated], meta: dict, prompt_tokens: int, include_usage: bool) -> AsyncIterator[bytes]:
        text = TextDelta(self.tokenizer)
        try:
            async for event in tokens:
                if not isinstance(event, Generated):
                    yield sse({**meta, "choices": [_choice(text.add(event), None)]})
                    continue
                yield sse({**meta, "choices": [_choice(text.flush(), "length")]})
                if include_usage:
                    yield sse({**meta, "choices": [], "usage": _usage(prompt_tokens, len(event.output_ids))})
                yield sse("[DONE]")
        except ApiError as error:
            yield sse(error.body())  # the client raises APIError from an "error" payload
        finally:
            await tokens.aclose()


def _choice(text: str, finish_reason: str | None) -> dict:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
