"""Unit tests of the API contract's request checking, without a server."""

from __future__ import annotations

import json

import pytest

from shared.schemas import ApiError, ContractLimits, build_response, parse_inference_request, request_id_from
from shared.tokenizer import ByteTokenizer

LIMITS = ContractLimits(vocab_size=258, n_ctx=64, max_new_tokens=40, max_body_bytes=1000)
TOKENIZER = ByteTokenizer()


def parse(body: object) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_inference_request(raw, LIMITS, TOKENIZER)


def test_ids_are_taken_as_they_are() -> None:
    valid = parse({"input_ids": [1, 2, 257], "max_new_tokens": 3})
    assert (valid.input_ids, valid.max_new_tokens) == ([1, 2, 257], 3)


def test_prompt_is_encoded_to_utf8_bytes() -> None:
    valid = parse({"prompt": "héllo", "max_new_tokens": 1})
    assert valid.input_ids == list("héllo".encode())


def test_max_new_tokens_defaults_to_32() -> None:
    assert parse({"prompt": "a"}).max_new_tokens == 32


def test_limits_are_inclusive() -> None:
    at_limit = parse({"input_ids": [5] * (LIMITS.n_ctx - LIMITS.max_new_tokens), "max_new_tokens": LIMITS.max_new_tokens})
    assert len(at_limit.input_ids) + at_limit.max_new_tokens == LIMITS.n_ctx
    assert parse({"input_ids": [LIMITS.vocab_size - 1, 0], "max_new_tokens": 1}).input_ids == [257, 0]


BAD_INPUTS = [
    # (what, body, status, error type)
    ("neither input", {"max_new_tokens": 4}, 422, "invalid_request"),
    ("both inputs", {"input_ids": [1], "prompt": "a"}, 422, "invalid_request"),
    ("string ids", {"input_ids": ["1", "2"]}, 422, "invalid_request"),
    ("bool ids", {"input_ids": [True, False]}, 422, "invalid_request"),
    ("float ids", {"input_ids": [1.0, 2.0]}, 422, "invalid_request"),
    ("ids not a list", {"input_ids": 5}, 422, "invalid_request"),
    ("prompt not a string", {"prompt": 5}, 422, "invalid_request"),
    ("float max_new_tokens", {"prompt": "a", "max_new_tokens": 4.0}, 422, "invalid_request"),
    ("string max_new_tokens", {"prompt": "a", "max_new_tokens": "4"}, 422, "invalid_request"),
    ("null max_new_tokens", {"prompt": "a", "max_new_tokens": None}, 422, "invalid_request"),
    ("unknown field", {"prompt": "a", "temperature": 0.7}, 422, "invalid_request"),
    ("body a list", [1, 2], 422, "invalid_request"),
    ("body null", None, 422, "invalid_request"),
    ("empty list", {"input_ids": []}, 422, "invalid_request"),
    ("empty prompt", {"prompt": ""}, 422, "invalid_request"),
    ("negative id", {"input_ids": [3, -1]}, 422, "invalid_request"),
    ("id == vocabulary size", {"input_ids": [LIMITS.vocab_size]}, 422, "invalid_request"),
    ("max_new_tokens 0", {"prompt": "a", "max_new_tokens": 0}, 422, "invalid_request"),
    ("max_new_tokens negative", {"prompt": "a", "max_new_tokens": -3}, 422, "invalid_request"),
    ("max_new_tokens over the limit", {"prompt": "a", "max_new_tokens": LIMITS.max_new_tokens + 1}, 422, "invalid_request"),
    ("context exceeded by ids", {"input_ids": [5] * (LIMITS.n_ctx - 3), "max_new_tokens": 4}, 422, "context_exceeded"),
    ("context exceeded by prompt", {"prompt": "é" * 30, "max_new_tokens": 5}, 422, "context_exceeded"),
    ("lone surrogate in the prompt", b'{"prompt": "\\ud800"}', 422, "invalid_request"),
    ("malformed JSON", b'{"prompt": ', 400, "invalid_json"),
    ("empty body", b"", 400, "invalid_json"),
    ("not UTF-8", b"\xff\xfe\x00", 400, "invalid_json"),
    ("body over the size limit", {"prompt": "a" * LIMITS.max_body_bytes}, 413, "body_too_large"),
]


@pytest.mark.parametrize(("body", "status", "type_"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_with_its_status(body: object, status: int, type_: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert (caught.value.status, caught.value.type) == (status, type_)
    assert caught.value.message
    assert caught.value.body() == {"error": {"type": type_, "message": caught.value.message}}


@pytest.mark.parametrize("sent", ["abc-123", "A.b_c-9", "x" * 64])
def test_a_sane_client_request_id_is_kept(sent: str) -> None:
    assert request_id_from(sent) == sent


@pytest.mark.parametrize("sent", [None, "", "has space", "x" * 65, "semi;colon", "ünï"])
def test_an_unusable_client_request_id_is_replaced(sent: str | None) -> None:
    fresh = request_id_from(sent)
    assert fresh != sent and len(fresh) == 32 and int(fresh, 16) >= 0


def test_response_counts_and_decodes() -> None:
    response = build_response("rid", 3, [104, 105], TOKENIZER, {"total": 1.23456})
    assert response.text == "hi"
    assert response.usage.model_dump() == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert response.timings_ms == {"total": 1.235}
