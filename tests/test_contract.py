"""The API contract, spoken by every chapter's real server process (one per chapter for this module).

Adding a chapter to ``chapters.CHAPTERS`` adds it here. Every answer is checked against the oracle
(computed in this process), never against another answer of the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests
from chapter_flags import oracle_exact_args

from benchmarks.harness.server_process import RunningServer
from chapters import CHAPTERS
from shared.settings import ServerSettings
from shared.tokenizer import ByteTokenizer

BODY_LIMIT = 4096  # small, so the 413 case stays cheap; every other case fits well under it
TOKENS_LIMIT = ServerSettings.model_fields["max_new_tokens_limit"].default
VOCAB = ByteTokenizer.vocab_size
TIMEOUT_S = 120


@pytest.fixture(scope="module", params=list(CHAPTERS))
def chapter_server(request, server) -> Iterator[RunningServer]:
    with server(request.param, *oracle_exact_args(request.param), "--max-body-bytes", str(BODY_LIMIT)) as running:
        yield running


def post(server: RunningServer, body: object, headers: dict[str, str] | None = None) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    return requests.post(f"{server.url}/v1/inference", data=data, headers=headers, timeout=TIMEOUT_S)


def assert_answer(response: requests.Response, prompt_ids: list[int], max_new_tokens: int, oracle) -> dict:
    """A 200 whose tokens are the oracle's and whose other fields agree with them."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"request_id", "output_ids", "text", "usage", "timings_ms"}
    expected = oracle(prompt_ids, max_new_tokens)
    assert body["output_ids"] == expected
    assert body["text"] == ByteTokenizer().decode(expected)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids), "completion_tokens": max_new_tokens, "total_tokens": len(prompt_ids) + max_new_tokens,
    }
    assert body["timings_ms"]["total"] >= 0
    assert response.headers["X-Request-ID"] == body["request_id"]
    return body


def assert_error(response: requests.Response, status: int, type_: str) -> None:
    """The documented status and exactly ``{"error": {"type", "message"}}``, tagged with a request id."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == type_
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert response.headers.get("X-Request-ID")


def test_healthz_names_the_chapter(chapter_server: RunningServer) -> None:
    response = requests.get(f"{chapter_server.url}/healthz", timeout=TIMEOUT_S)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["chapter"] == chapter_server.chapter
    assert body["model"].startswith("default:")


def test_request_by_ids(chapter_server: RunningServer, oracle) -> None:
    ids = list(b"21+43=")
    assert_answer(post(chapter_server, {"input_ids": ids, "max_new_tokens": 5}), ids, 5, oracle)


def test_request_by_prompt(chapter_server: RunningServer, oracle) -> None:
    prompt = "the brave fox "
    body = assert_answer(post(chapter_server, {"prompt": prompt, "max_new_tokens": 12}), list(prompt.encode()), 12, oracle)
    assert body["text"]  # readable output from the trained default model


def test_max_new_tokens_defaults_to_32(chapter_server: RunningServer, oracle) -> None:
    assert_answer(post(chapter_server, {"prompt": "55+17="}), list(b"55+17="), 32, oracle)


def test_client_request_id_is_echoed(chapter_server: RunningServer, oracle) -> None:
    response = post(chapter_server, {"prompt": "a", "max_new_tokens": 1}, headers={"X-Request-ID": "client-7.a_b"})
    assert assert_answer(response, [97], 1, oracle)["request_id"] == "client-7.a_b"


def test_each_request_gets_its_own_id(chapter_server: RunningServer) -> None:
    ids = {post(chapter_server, {"prompt": "a", "max_new_tokens": 1}).json()["request_id"] for _ in range(3)}
    assert len(ids) == 3


BAD_INPUTS = [
    # (what, body, status, error type)
    ("neither input", {"max_new_tokens": 4}, 422, "invalid_request"),
    ("both inputs", {"input_ids": [1], "prompt": "a"}, 422, "invalid_request"),
    ("string ids", {"input_ids": ["1", "2"]}, 422, "invalid_request"),
    ("bool ids", {"input_ids": [True, False]}, 422, "invalid_request"),
    ("float max_new_tokens", {"prompt": "a", "max_new_tokens": 4.0}, 422, "invalid_request"),
    ("prompt not a string", {"prompt": ["a"]}, 422, "invalid_request"),
    ("unknown field", {"prompt": "a", "best_of": 2}, 422, "invalid_request"),
    ("body not an object", [1, 2, 3], 422, "invalid_request"),
    ("empty list", {"input_ids": []}, 422, "invalid_request"),
    ("empty prompt", {"prompt": ""}, 422, "invalid_request"),
    ("lone surrogate in the prompt", b'{"prompt": "\\ud800"}', 422, "invalid_request"),
    ("negative id", {"input_ids": [65, -1]}, 422, "invalid_request"),
    ("id == vocabulary size", {"input_ids": [VOCAB]}, 422, "invalid_request"),
    ("huge id", {"input_ids": [2**63]}, 422, "invalid_request"),
    ("max_new_tokens 0", {"prompt": "a", "max_new_tokens": 0}, 422, "invalid_request"),
    ("max_new_tokens negative", {"prompt": "a", "max_new_tokens": -1}, 422, "invalid_request"),
    ("max_new_tokens over the limit", {"prompt": "a", "max_new_tokens": TOKENS_LIMIT + 1}, 422, "invalid_request"),
    ("prompt + new tokens over the context", {"input_ids": [65] * 500, "max_new_tokens": 13}, 422, "context_exceeded"),
    ("malformed JSON", b'{"prompt": "a", ', 400, "invalid_json"),
    ("not UTF-8", b"\xff\xfe\xfd", 400, "invalid_json"),
    ("body over the size limit", {"prompt": "a" * (2 * BODY_LIMIT)}, 413, "body_too_large"),
]


@pytest.mark.parametrize(("body", "status", "type_"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_its_status_and_a_json_error(chapter_server: RunningServer, body: object, status: int, type_: str) -> None:
    assert_error(post(chapter_server, body), status, type_)


SAMPLING_CHAPTERS = {"ch08"}  # chapters whose /v1/inference takes the sampling fields (chapter 8's scheduler samples)


def test_sampling_fields_are_refused_where_the_chapter_decodes_only_greedily(chapter_server: RunningServer, oracle) -> None:
    """Chapters 1-7 decode greedily: a sampling field is unknown there (422), never silently ignored."""
    response = post(chapter_server, {"prompt": "a", "max_new_tokens": 4, "temperature": 0.7, "seed": 1})
    if chapter_server.chapter in SAMPLING_CHAPTERS:
        assert response.status_code == 200 and len(response.json()["output_ids"]) == 4
        assert_answer(post(chapter_server, {"prompt": "a", "max_new_tokens": 4, "temperature": 0}), [97], 4, oracle)
    else:
        assert_error(response, 422, "invalid_request")
        assert "temperature" in response.json()["error"]["message"]


def test_chunked_request_within_the_limit(chapter_server: RunningServer, oracle) -> None:
    body = json.dumps({"prompt": "90+11=", "max_new_tokens": 4}).encode()
    response = requests.post(
        f"{chapter_server.url}/v1/inference", data=iter([body[:7], body[7:]]), headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert_answer(response, list(b"90+11="), 4, oracle)


def test_chunked_body_over_the_size_limit_is_413(chapter_server: RunningServer) -> None:
    """Without a Content-Length the server can only find out by reading: it must stop at the limit."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(2 * BODY_LIMIT // 512):
            yield b"a" * 512
        yield b'"}'

    response = requests.post(
        f"{chapter_server.url}/v1/inference", data=chunks(), headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S
    )
    assert_error(response, 413, "body_too_large")


def test_unknown_route_is_404(chapter_server: RunningServer) -> None:
    assert_error(requests.get(f"{chapter_server.url}/v1/nothing-here", timeout=TIMEOUT_S), 404, "not_found")


def test_wrong_method_is_405(chapter_server: RunningServer) -> None:
    assert_error(requests.get(f"{chapter_server.url}/v1/inference", timeout=TIMEOUT_S), 405, "method_not_allowed")


def test_still_correct_after_every_bad_input(chapter_server: RunningServer, oracle) -> None:
    for _, body, status, type_ in BAD_INPUTS:
        assert_error(post(chapter_server, body), status, type_)
    ids = list(b"the quiet baker reads ")
    assert_answer(post(chapter_server, {"input_ids": ids, "max_new_tokens": 16}), ids, 16, oracle)
    assert chapter_server.process.poll() is None  # nothing a client sent stopped the server
