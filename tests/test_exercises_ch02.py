"""Graded tests of chapter 2's exercises: inference off the event loop (ch02.1), the stage timings
(ch02.2), the body limit (ch02.3).

No server and no model: the model is a fake ``greedy_generate`` that the test holds and releases
with events, and that records which thread ran it and how many ran at once. Time is a fake
``perf_counter`` moved by the fake model. The HTTP side is the real app, driven in-process by httpx.
"""

from __future__ import annotations

import asyncio
import threading
import types

import httpx
import pytest
from starlette.requests import Request

from chapters.ch02_fastapi_async import server
from chapters.ch02_fastapi_async.api import Generated, create_app, read_body
from shared.schemas import ApiError, ContractLimits, ValidRequest
from shared.tokenizer import ByteTokenizer

SAFETY_TIMEOUT_S = 10  # only so a broken solution fails a test instead of hanging it


async def still_connected() -> bool:
    return False


class HeldModel:
    """Stands in for ``greedy_generate``: each call waits until the test releases it.

    Records the thread of every call and the most calls that were inside at once.
    """

    def __init__(self) -> None:
        self.entered: list[threading.Event] = []  # one per call, set when the call starts
        self.release = threading.Event()
        self.threads: list[int] = []
        self.prompts: list[list[int]] = []
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()
        self._calls = threading.Semaphore(0)

    def expect(self, n: int) -> None:
        self.entered = [threading.Event() for _ in range(n)]

    def __call__(self, model, input_ids: list[int], max_new_tokens: int) -> list[int]:
        with self._lock:
            index = len(self.threads)
            self.threads.append(threading.get_ident())
            self.prompts.append(list(input_ids))
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.entered[index].set()
        try:
            if not self.release.wait(SAFETY_TIMEOUT_S):
                raise AssertionError("the test could not release the model: the event loop was blocked while it computed")
            return [input_ids[0] + 1] * max_new_tokens
        finally:
            with self._lock:
                self.active -= 1


def backend_with(monkeypatch: pytest.MonkeyPatch, fake) -> server.OneThreadBackend:
    monkeypatch.setattr(server, "greedy_generate", fake)
    return server.OneThreadBackend(model=object(), description={"chapter": "ch02-graded"})


async def until_entered(call: asyncio.Future, entered: threading.Event) -> None:
    """Wait until the fake model was entered; if the request ends first (a stub raised), raise its error."""
    waiter = asyncio.ensure_future(asyncio.to_thread(entered.wait, SAFETY_TIMEOUT_S))
    done, _ = await asyncio.wait({call, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if call in done and not entered.is_set():
        waiter.cancel()
        call.result()  # re-raises what ended the request
        raise AssertionError("the request finished without running the model")
    assert await waiter, "the model was never called"


def app_for(backend: server.OneThreadBackend):
    tokenizer = ByteTokenizer()
    limits = ContractLimits(vocab_size=tokenizer.vocab_size, n_ctx=64, max_new_tokens=16, max_body_bytes=256)
    return create_app(title="ch02 graded", limits=limits, tokenizer=tokenizer, backend=backend)


# ----------------------------------------------------------------------------- ch02.1: off the loop


@pytest.mark.exercise("ch02.1")
def test_the_event_loop_answers_healthz_while_a_generation_is_held_in_the_inference_thread(monkeypatch) -> None:
    model = HeldModel()
    model.expect(1)
    backend = backend_with(monkeypatch, model)

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        transport = httpx.ASGITransport(app=app_for(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            held = asyncio.ensure_future(client.post("/v1/inference", json={"input_ids": [7, 8], "max_new_tokens": 3}))
            await until_entered(held, model.entered[0])
            health = await client.get("/healthz")  # the model is still held: only a free loop can answer
            assert health.status_code == 200 and health.json()["chapter"] == "ch02-graded"
            assert not held.done()
            model.release.set()
            reply = await held
        assert reply.status_code == 200, reply.text
        assert reply.json()["output_ids"] == [8, 8, 8]
        assert model.threads[0] != loop_thread, "the model ran on the event loop's thread"

    try:
        asyncio.run(scenario())
    finally:
        model.release.set()
        backend._thread.shutdown(wait=True)


@pytest.mark.exercise("ch02.1")
def test_requests_take_turns_in_one_inference_thread_never_two_at_once(monkeypatch) -> None:
    model = HeldModel()
    model.expect(4)
    backend = backend_with(monkeypatch, model)

    async def scenario() -> None:
        first = asyncio.ensure_future(backend.generate(ValidRequest(input_ids=[10], max_new_tokens=1), still_connected))
        await until_entered(first, model.entered[0])
        # Three more arrive while the first holds the model: with one inference thread they queue behind it.
        rest = [asyncio.ensure_future(backend.generate(ValidRequest(input_ids=[20 + i], max_new_tokens=1), still_connected))
                for i in range(3)]
        await asyncio.sleep(0)  # let them reach their executor (they hand over the request, then wait)
        model.release.set()
        results = await asyncio.wait_for(asyncio.gather(first, *rest), SAFETY_TIMEOUT_S)
        assert [r.output_ids for r in results] == [[11], [21], [22], [23]]
        assert all(isinstance(r, Generated) for r in results)

    try:
        asyncio.run(scenario())
    finally:
        model.release.set()
        backend._thread.shutdown(wait=True)
    assert model.most_active == 1, f"{model.most_active} generations ran the model at the same time"
    assert len(set(model.threads)) == 1, "every request goes through the ONE inference thread (the backend's own executor)"
    assert model.prompts == [[10], [20], [21], [22]], "in the order they arrived"
    assert backend.served == 4


# ----------------------------------------------------------------------------- ch02.2: stage timings


class FakeTime:
    """Stands in for the ``time`` module inside ``server``: a perf_counter moved by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def perf_counter(self) -> float:
        return self.now


def timed_backend(monkeypatch: pytest.MonkeyPatch, clock: FakeTime, inference_s: float, calls: list) -> server.OneThreadBackend:
    def fake_generate(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
        calls.append((model, list(input_ids), max_new_tokens))
        clock.now += inference_s
        return list(range(max_new_tokens))

    monkeypatch.setattr(server, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    backend = backend_with(monkeypatch, fake_generate)
    backend.model = "the-model"
    return backend


@pytest.mark.exercise("ch02.2")
def test_queue_is_counted_from_submission_and_inference_is_the_models_own_time(monkeypatch) -> None:
    clock, calls = FakeTime(100.25), []
    backend = timed_backend(monkeypatch, clock, inference_s=0.5, calls=calls)
    try:
        result = backend._run(ValidRequest(input_ids=[1, 2, 3], max_new_tokens=4), 100.0)  # submitted 0.25 s ago
    finally:
        backend._thread.shutdown(wait=True)
    assert calls == [("the-model", [1, 2, 3], 4)], "the backend's model, the request's ids and token count"
    assert result.output_ids == [0, 1, 2, 3]
    assert result.timings_ms == {"queue": 250.0, "inference": 500.0}, "milliseconds: queue until the model starts, then the model"
    assert backend.served == 1


@pytest.mark.exercise("ch02.2")
def test_every_request_is_counted_and_timed_on_its_own(monkeypatch) -> None:
    clock, calls = FakeTime(8.0), []
    backend = timed_backend(monkeypatch, clock, inference_s=0.125, calls=calls)
    try:
        first = backend._run(ValidRequest(input_ids=[5], max_new_tokens=1), 8.0)
        second = backend._run(ValidRequest(input_ids=[6], max_new_tokens=2), 8.0)  # waited while the first ran
    finally:
        backend._thread.shutdown(wait=True)
    assert first.timings_ms == {"queue": 0.0, "inference": 125.0}
    assert second.timings_ms == {"queue": 125.0, "inference": 125.0}
    assert backend.served == 2 and backend.stats()["served"] == 2


# ----------------------------------------------------------------------------- ch02.3: the body limit


class Body:
    """An ASGI request whose body arrives in chunks; counts the chunks the server actually read."""

    def __init__(self, chunks: list[bytes], declared: int | None) -> None:
        self.chunks = chunks
        self.read = 0
        headers = [(b"content-type", b"application/json")]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        self.scope = {"type": "http", "method": "POST", "path": "/v1/inference", "headers": headers,
                      "query_string": b"", "http_version": "1.1", "scheme": "http"}

    async def receive(self) -> dict:
        if self.read >= len(self.chunks):
            raise AssertionError("read past the end of the body")
        self.read += 1
        return {"type": "http.request", "body": self.chunks[self.read - 1], "more_body": self.read < len(self.chunks)}

    def request(self) -> Request:
        return Request(self.scope, self.receive)


def read(body: Body, limit: int) -> bytes:
    return asyncio.run(read_body(body.request(), limit))


@pytest.mark.exercise("ch02.3")
def test_a_declared_size_over_the_limit_is_refused_before_reading_anything() -> None:
    body = Body([b"x" * 8] * 4, declared=32)
    with pytest.raises(ApiError) as refused:
        read(body, limit=31)
    assert (refused.value.status, refused.value.type) == (413, "body_too_large")
    assert body.read == 0, "the header says it all: not one chunk may be read"


@pytest.mark.exercise("ch02.3")
def test_a_stream_that_passes_the_limit_is_refused_as_soon_as_it_does() -> None:
    body = Body([b"a" * 4] * 10, declared=None)  # 40 bytes, no Content-Length (chunked transfer)
    with pytest.raises(ApiError) as refused:
        read(body, limit=10)
    assert (refused.value.status, refused.value.type) == (413, "body_too_large")
    assert body.read == 3, "12 bytes after the third chunk pass 10: stop there, never read the rest"


@pytest.mark.exercise("ch02.3")
def test_a_client_that_declares_less_than_it_sends_is_still_stopped() -> None:
    body = Body([b"b" * 6] * 5, declared=6)
    with pytest.raises(ApiError) as refused:
        read(body, limit=16)
    assert refused.value.status == 413 and body.read == 3


@pytest.mark.exercise("ch02.3")
@pytest.mark.parametrize("declared", [None, 12])
def test_a_body_of_exactly_the_limit_is_read_whole(declared: int | None) -> None:
    body = Body([b"abcd", b"efgh", b"ijkl"], declared=declared)
    assert read(body, limit=12) == b"abcdefghijkl"
    assert body.read == 3


@pytest.mark.exercise("ch02.3")
def test_the_endpoint_answers_413_and_the_backend_never_sees_the_request(monkeypatch) -> None:
    calls = []
    backend = backend_with(monkeypatch, lambda model, ids, n: calls.append(ids) or [0] * n)

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app_for(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/inference", content=b"{" + b" " * 1000 + b"}",
                                     headers={"content-type": "application/json"})

    try:
        reply = asyncio.run(scenario())
    finally:
        backend._thread.shutdown(wait=True)
    assert reply.status_code == 413 and reply.json()["error"]["type"] == "body_too_large"
    assert calls == []
