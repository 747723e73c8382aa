"""Graded tests of chapter 1's exercises: the request's life and timings (ch01.1), the JSON errors
(ch01.2), splitting the cores between workers (ch01.3).

The Flask app is built around a fake backend and driven by Flask's test client: no server, no model.
Time is a fake ``perf_counter`` that moves only when the fake parse and the fake backend say so.
"""

from __future__ import annotations

import types

import pytest
from flask import Flask

import chapters.ch01_flask_sync.api as api
import chapters.ch01_flask_sync.server as server
from shared.schemas import REQUEST_ID_HEADER, ApiError, ContractLimits, ValidRequest
from shared.tokenizer import ByteTokenizer

PARSE_S = 0.0625  # what the fake parse costs (exact in binary, so the sums are exact)
GENERATE_S = 0.25  # what the fake backend costs


class FakeTime:
    """Stands in for the ``time`` module inside ``api``: a perf_counter that moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class FakeBackend:
    def __init__(self, clock: FakeTime, fail: Exception | None = None) -> None:
        self.clock = clock
        self.fail = fail
        self.calls: list[ValidRequest] = []

    def __call__(self, request: ValidRequest) -> tuple[list[int], dict[str, float]]:
        self.calls.append(request)
        self.clock.now += GENERATE_S
        if self.fail is not None:
            raise self.fail
        return [104, 105], {"queue": 50.0, "inference": 200.0}


@pytest.fixture
def app_parts(monkeypatch: pytest.MonkeyPatch) -> tuple[Flask, FakeBackend]:
    clock = FakeTime()
    real_parse = api.parse_inference_request

    def timed_parse(*args, **kwargs):
        clock.now += PARSE_S
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(api, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(api, "parse_inference_request", timed_parse)
    backend = FakeBackend(clock)
    tokenizer = ByteTokenizer()
    limits = ContractLimits(vocab_size=tokenizer.vocab_size, n_ctx=64, max_new_tokens=16, max_body_bytes=256)
    app = create(limits, tokenizer, backend)
    return app, backend


def create(limits: ContractLimits, tokenizer: ByteTokenizer, backend: FakeBackend) -> Flask:
    app = api.create_app(title="graded", limits=limits, tokenizer=tokenizer, generate=backend)
    # An exception inside an error handler reaches the test (with its exercise id) instead of
    # becoming Flask's own HTML 500 page.
    app.config["PROPAGATE_EXCEPTIONS"] = True
    return app


# ----------------------------------------------------------------------------- ch01.1: the request's life


@pytest.mark.exercise("ch01.1")
def test_a_request_is_parsed_generated_and_answered_with_its_stage_timings(app_parts) -> None:
    app, backend = app_parts
    reply = app.test_client().post("/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 2},
                                   headers={REQUEST_ID_HEADER: "req-42"})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    body = reply.get_json()
    assert backend.calls == [ValidRequest(input_ids=[1, 2, 3], max_new_tokens=2)]
    assert body["output_ids"] == [104, 105] and body["text"] == "hi"
    assert body["request_id"] == "req-42" and reply.headers[REQUEST_ID_HEADER] == "req-42"
    assert body["usage"]["prompt_tokens"] == 3
    timings = body["timings_ms"]
    assert timings["parse"] == pytest.approx(PARSE_S * 1e3), "parse: from the handler's start to a checked request"
    assert (timings["queue"], timings["inference"]) == (50.0, 200.0), "the backend's own stages, passed through"
    assert timings["total"] == pytest.approx((PARSE_S + GENERATE_S) * 1e3), "total: the handler's start to the answer"


@pytest.mark.exercise("ch01.1")
def test_a_prompt_is_tokenized_before_it_reaches_the_backend(app_parts) -> None:
    app, backend = app_parts
    reply = app.test_client().post("/v1/inference", json={"prompt": "ab", "max_new_tokens": 1})
    assert reply.status_code == 200, reply.get_data(as_text=True)
    assert backend.calls == [ValidRequest(input_ids=ByteTokenizer().encode("ab"), max_new_tokens=1)]
    assert reply.headers[REQUEST_ID_HEADER] == reply.get_json()["request_id"]


# ----------------------------------------------------------------------------- ch01.2: the errors


def assert_contract_error(reply, status: int, error_type: str) -> dict:
    assert reply.status_code == status, reply.get_data(as_text=True)
    assert reply.mimetype == "application/json", f"errors are JSON, got {reply.mimetype}"
    error = reply.get_json()["error"]
    assert error["type"] == error_type and error["message"]
    assert reply.headers.get(REQUEST_ID_HEADER), "every answer carries the request id, errors included"
    return error


@pytest.mark.exercise("ch01.2")
def test_invalid_fields_get_422_and_never_reach_the_backend(app_parts) -> None:
    app, backend = app_parts
    reply = app.test_client().post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 0})
    assert reply.status_code == 422
    assert_contract_error(reply, 422, reply.get_json()["error"]["type"])
    assert backend.calls == []


@pytest.mark.exercise("ch01.2")
def test_an_api_error_from_the_backend_keeps_its_status_type_and_headers(app_parts) -> None:
    app, backend = app_parts
    backend.fail = ApiError(429, "queue_full", "come back later", {"Retry-After": "2"})
    reply = app.test_client().post("/v1/inference", json={"input_ids": [1], "max_new_tokens": 1})
    assert_contract_error(reply, 429, "queue_full")
    assert reply.headers["Retry-After"] == "2"


@pytest.mark.exercise("ch01.2")
def test_a_body_over_the_limit_gets_413(app_parts) -> None:
    app, backend = app_parts
    reply = app.test_client().post("/v1/inference", data=b"x" * 1000, content_type="application/json")
    assert_contract_error(reply, 413, "body_too_large")
    assert backend.calls == []


@pytest.mark.exercise("ch01.2")
def test_unknown_routes_and_wrong_methods_get_json_not_html(app_parts) -> None:
    app, _backend = app_parts
    client = app.test_client()
    assert_contract_error(client.get("/nowhere"), 404, "not_found")
    wrong_method = client.get("/v1/inference")
    assert_contract_error(wrong_method, 405, "method_not_allowed")
    assert "POST" in wrong_method.headers["Allow"]


@pytest.mark.exercise("ch01.2")
def test_an_unexpected_failure_gets_500_naming_the_exception(app_parts) -> None:
    app, backend = app_parts
    backend.fail = RuntimeError("the model broke")
    reply = app.test_client().post("/v1/inference", json={"input_ids": [1], "max_new_tokens": 1})
    error = assert_contract_error(reply, 500, "internal_error")
    assert "RuntimeError" in error["message"] and "the model broke" in error["message"]


# ----------------------------------------------------------------------------- ch01.3: threads per worker


@pytest.mark.exercise("ch01.3")
@pytest.mark.parametrize(
    ("cpus", "workers", "torch_threads", "expected"),
    [
        (8, 1, 0, 0),  # one worker: torch's default (every core)
        (8, 4, 0, 2),  # four workers share eight cores
        (8, 3, 0, 2),  # rounded down: never more threads than cores in total
        (8, 16, 0, 1),  # more workers than cores: at least one thread each
        (None, 2, 0, 1),  # the core count is unknown: assume one
        (8, 4, 3, 3),  # asked for explicitly: that wins
        (8, 1, 5, 5),
    ],
)
def test_each_worker_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch, cpus, workers, torch_threads, expected) -> None:
    monkeypatch.setattr(server.os, "cpu_count", lambda: cpus)
    settings = types.SimpleNamespace(workers=workers, torch_threads=torch_threads)
    assert server.torch_threads_per_worker(settings) == expected
