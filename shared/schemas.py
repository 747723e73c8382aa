"""The API contract every chapter speaks, in one place: request and response models, errors, limits.

``POST /v1/inference`` takes ``input_ids`` or ``prompt`` (exactly one) and ``max_new_tokens``. Errors are ``{"error": {"type",
"message"}}``: 400 not JSON, 413 too large, 422 invalid (ids out of vocabulary, over the context), 429 queue full (Retry-After),
503 not ready or draining, 500 a failed batch, 504 past a deadline."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from shared.tokenizer import Tokenizer

REQUEST_ID_HEADER = "X-Request-ID"
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")


class InferenceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: list[StrictInt] | None = None
    prompt: StrictStr | None = None
    max_new_tokens: StrictInt = 32

    @model_validator(mode="after")
    def _exactly_one_input(self) -> InferenceRequest:
        if (self.input_ids is None) == (self.prompt is None):
            raise ValueError("send exactly one of input_ids and prompt")
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class InferenceResponse(BaseModel):
    request_id: str
    output_ids: list[int]
    text: str
    usage: Usage
    timings_ms: dict[str, float]


class ApiError(Exception):
    """An error the client caused or must react to; rendered as the contract's JSON error."""

    def __init__(self, status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.type, self.message)


# The error type of statuses the web framework raises itself (unknown route, wrong method, body limit).
STATUS_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def error_body(type_: str, message: str) -> dict:
    return {"error": {"type": type_, "message": message}}


@dataclass(frozen=True)
class ContractLimits:
    """What a server accepts; derived from its model and settings."""

    vocab_size: int
    n_ctx: int
    max_new_tokens: int
    max_body_bytes: int


@dataclass(frozen=True)
class ValidRequest:
    input_ids: list[int]
    max_new_tokens: int


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False):
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_inference_request(body: bytes, limits: ContractLimits, tokenizer: Tokenizer) -> ValidRequest:
    """Turn a raw request body into checked ids, or raise :class:`ApiError` saying what is wrong."""
    request = read_inference_request(body, limits)
    return ValidRequest(input_ids=checked_prompt(request, limits, tokenizer), max_new_tokens=request.max_new_tokens)


def read_inference_request(body: bytes, limits: ContractLimits, schema: type[InferenceRequest] = InferenceRequest) -> InferenceRequest:
    """The body as ``schema`` (the contract's request, or a chapter's extension of it); 413, 400 or 422 if it is not one."""
    if len(body) > limits.max_body_bytes:
        raise ApiError(413, "body_too_large", f"request body is {len(body)} bytes; the limit is {limits.max_body_bytes}")
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", _describe(exc)) from None


def checked_prompt(request: InferenceRequest, limits: ContractLimits, tokenizer: Tokenizer) -> list[int]:
    """The request's prompt as ids (its ``prompt`` encoded, or its ``input_ids``), within ``limits``; else 422."""
    if request.prompt is not None:
        try:
            ids = tokenizer.encode(request.prompt)
        except ValueError as exc:
            raise ApiError(422, "invalid_request", str(exc)) from None
    else:
        ids = request.input_ids or []
    return check_limits(ids, request.max_new_tokens, limits)


def check_limits(ids: list[int], max_new_tokens: int, limits: ContractLimits) -> list[int]:
    if not ids:
        raise ApiError(422, "invalid_request", "the prompt is empty: send at least one token")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ApiError(422, "invalid_request", f"input_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise ApiError(422, "invalid_request", f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {max_new_tokens}")
    if len(ids) + max_new_tokens > limits.n_ctx:
        raise ApiError(
            422, "context_exceeded",
            f"{len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the context of {limits.n_ctx}",
        )
    return ids


def request_id_from(header_value: str | None) -> str:
    """The client's ``X-Request-ID`` when it is a sane token, else a fresh one."""
    if header_value and _CLIENT_REQUEST_ID.match(header_value):
        return header_value
    return uuid.uuid4().hex


def build_response(
    request_id: str, prompt_len: int, output_ids: list[int], tokenizer: Tokenizer, timings_ms: dict[str, float]
) -> InferenceResponse:
    return InferenceResponse(
        request_id=request_id,
        output_ids=output_ids,
        text=tokenizer.decode(output_ids),
        usage=Usage(prompt_tokens=prompt_len, completion_tokens=len(output_ids), total_tokens=prompt_len + len(output_ids)),
        timings_ms={k: round(v, 3) for k, v in timings_ms.items()},
    )
