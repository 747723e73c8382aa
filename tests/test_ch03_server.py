"""Chapter 3's server with a batch runner that breaks: exactly the requests of the broken batch get 500.

The app runs in-process (Starlette's TestClient runs its lifespan, so the batcher starts and drains
as in production); the model is the dummy one, since the injected runner never calls it.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from fastapi.testclient import TestClient

from chapters.ch02_fastapi_async.api import Generated
from chapters.ch03_dynamic_batching.server import BatchingSettings, build_app
from shared.schemas import ValidRequest

POISON = 99  # a request whose first token is this breaks its whole batch


class BreakingRunner:
    """Echoes each request's first token ``max_new_tokens`` times; raises for a batch holding POISON."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self._lock = threading.Lock()

    def __call__(self, requests: list[ValidRequest]) -> list[Generated]:
        firsts = [r.input_ids[0] for r in requests]
        with self._lock:
            self.batches.append(firsts)
        if POISON in firsts:
            raise RuntimeError("injected failure")
        return [Generated([r.input_ids[0]] * r.max_new_tokens, {"batch": 0.0}) for r in requests]


def test_a_failing_batch_gets_500_for_exactly_its_requests_and_the_server_keeps_serving() -> None:
    runner = BreakingRunner()
    settings = BatchingSettings(weights="dummy", device="cpu", min_batch=4, max_batch=4, window_ms=20)
    with TestClient(build_app(settings, run_batch=runner)) as client:
        firsts = [1, 2, POISON, 4, 5, 6, 7, 8]
        with ThreadPoolExecutor(len(firsts)) as pool:
            responses = list(pool.map(
                lambda first: client.post("/v1/inference", json={"input_ids": [first, 0], "max_new_tokens": 3}), firsts
            ))
        doomed = {first for batch in runner.batches if POISON in batch for first in batch}
        for first, response in zip(firsts, responses):
            if first in doomed:
                assert response.status_code == 500, response.text
                assert response.json()["error"]["type"] == "batch_failed"
            else:
                assert response.status_code == 200, response.text
                assert response.json()["output_ids"] == [first] * 3
        assert sum(len(batch) for batch in runner.batches) == len(firsts)

        after = client.post("/v1/inference", json={"input_ids": [42], "max_new_tokens": 2})
        assert after.status_code == 200 and after.json()["output_ids"] == [42, 42]
        health = client.get("/healthz").json()
        assert health["chapter"] == "ch03"
        assert health["batcher"]["failed_batches"] == 1
        assert {k: health["batcher"][k] for k in ("max_batch", "min_batch", "window_ms")} == {
            "max_batch": 4, "min_batch": 4, "window_ms": 20.0,
        }


def test_settings_refuse_min_batch_above_max_batch() -> None:
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError):
        BatchingSettings(min_batch=9, max_batch=8)


def test_sigterm_finishes_the_queued_requests_and_exits_cleanly() -> None:
    """Graceful shutdown: requests already inside the server all get their answer, then exit status 0."""
    import time

    import requests

    from benchmarks.harness.server_process import running_server, stop

    n_requests = 12
    with running_server("ch03", ["--weights", "dummy", "--device", "cpu", "--min-batch", "4", "--max-batch", "4"]) as server:

        def send(first: int) -> requests.Response:
            return requests.post(f"{server.url}/v1/inference", json={"input_ids": [first, 1, 2], "max_new_tokens": 16}, timeout=120)

        with ThreadPoolExecutor(n_requests) as pool:
            responses = [pool.submit(send, i) for i in range(n_requests)]
            # Wait (polling another process: there is no event to await) until every request is
            # queued or computing, then ask the server to stop while they are still inside it.
            while True:
                batcher = requests.get(f"{server.url}/healthz", timeout=10).json()["batcher"]
                if batcher["queued"] + batcher["requests"] >= n_requests:
                    break
                time.sleep(0.01)
            exit_code = stop(server)
            statuses = [r.result().status_code for r in responses]
    assert statuses == [200] * n_requests
    # uvicorn finishes its graceful shutdown, then re-raises SIGTERM: "terminated by SIGTERM" is clean.
    assert exit_code in (0, -signal.SIGTERM), server.log_tail()


def test_the_real_server_computes_concurrent_mixed_length_requests_in_one_batch(oracle) -> None:
    """A recorder on the model itself: eight requests at once reach it as rows of the same forward passes."""
    settings = BatchingSettings(weights="default", device="cpu", min_batch=8, max_batch=8, window_ms=10_000)
    app = build_app(settings)
    model = app.state.backend.batcher._run_batch.model
    rows_per_decode: list[int] = []
    hook = model.register_forward_hook(lambda _m, args, _out: rows_per_decode.append(args[0].shape[0]) if args[0].shape[1] == 1 else None)
    prompts = [list(range(3, 3 + length)) for length in (2, 5, 9, 4, 12, 7, 3, 6)]
    try:
        with TestClient(app) as client, ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(
                lambda p: client.post("/v1/inference", json={"input_ids": p, "max_new_tokens": 5}), prompts
            ))
    finally:
        hook.remove()
    assert [r.json()["output_ids"] for r in responses] == [oracle(p, 5) for p in prompts]
    assert rows_per_decode == [8] * 4  # one batch: every decode step computed all eight rows together


def test_a_client_gone_while_queued_is_never_computed() -> None:
    """The backend hands the batcher its client's disconnect check: a request whose client left is dropped (499)."""
    import asyncio

    from shared.schemas import ApiError

    runner = BreakingRunner()
    settings = BatchingSettings(weights="dummy", device="cpu", min_batch=1, max_batch=1, window_ms=0)
    backend = build_app(settings, run_batch=runner).state.backend

    async def gone() -> bool:
        return True

    async def scenario() -> None:
        await backend.start()
        try:
            try:
                await backend.generate(ValidRequest([7, 1], 2), gone)
            except ApiError as error:
                assert error.status == 499
            else:
                raise AssertionError("a request whose client left was answered")
            assert runner.batches == []  # never computed
        finally:
            await backend.close()

    asyncio.run(scenario())
