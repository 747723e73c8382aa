"""Chapter 8's server in-process (httpx's ASGI transport): the contract, /stats, overload, deadlines, failures.

A gate around the model holds the engine between steps when a test needs a state to last; tests wait
for states, never for time. Streams and disconnects need a real socket: test_ch08_streaming.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from asgi_helpers import serving, until

from chapters.ch08_continuous_batching.scheduler import Sequence
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app


class GatedModel:
    """The real model, but each packed step waits for the test to open the gate (or fails, when told to)."""

    def __init__(self, model) -> None:
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def forward_packed(self, *args):
        assert self.gate.wait(timeout=60)
        if self.fail:
            raise RuntimeError("injected failure")
        return self.model.forward_packed(*args)


def settings(**overrides) -> ContinuousSettings:
    base = {"weights": "default", "device": "cpu", "precision": "fp32", "pool_tokens": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 64}
    return ContinuousSettings(**{**base, **overrides})


def run(app, scenario) -> None:
    asyncio.run(serving(app, scenario))


def test_inference_returns_the_oracles_tokens_with_the_contracts_fields(oracle) -> None:
    app = build_app(settings())
    prompts = [([5, 6, 7], 9), (list(range(40, 100)), 20), ([1], 1)]

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*(client.post("/v1/inference", json={"input_ids": p, "max_new_tokens": n}) for p, n in prompts))
        for answer, (p, n) in zip(answers, prompts):
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["output_ids"] == oracle(p, n)
            assert body["usage"] == {"prompt_tokens": len(p), "completion_tokens": n, "total_tokens": len(p) + n}
            assert {"queue", "prefill", "ttft", "decode", "total"} <= set(body["timings_ms"])
            assert answer.headers["X-Request-ID"] == body["request_id"]
        stats = (await client.get("/stats")).json()["scheduler"]
        assert stats["finished"] == 3 and stats["blocks_used"] == 0 and stats["blocks_free"] == stats["blocks_total"]
        assert stats["running"] == stats["waiting"] == 0 and stats["tokens_per_step"] > 0

    run(app, scenario)


@pytest.mark.parametrize(
    ("body", "status", "type_"),
    [
        ({"input_ids": [1, 2], "max_new_tokens": 4, "stream": "yes"}, 422, "invalid_request"),
        ({"input_ids": [1, 2], "max_new_tokens": 600}, 422, "invalid_request"),
        ({"input_ids": list(range(200)) * 2, "max_new_tokens": 200}, 422, "context_exceeded"),
        ({"input_ids": [999], "max_new_tokens": 4, "stream": True}, 422, "invalid_request"),
    ],
)
def test_bad_requests_get_the_contracts_error_before_any_stream_starts(body: dict, status: int, type_: str) -> None:
    app = build_app(settings())

    async def scenario(client: httpx.AsyncClient) -> None:
        answer = await client.post("/v1/inference", json=body)
        assert answer.status_code == status and answer.json()["error"]["type"] == type_
        assert (await client.post("/v1/inference", content=b"{not json")).status_code == 400

    run(app, scenario)


def test_past_max_num_seqs_plus_max_queue_requests_get_429_with_retry_after() -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(max_num_seqs=1, max_num_batched_tokens=1, max_queue=1), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]
    gate.gate.clear()
    backend = app.state.backend

    async def scenario(client: httpx.AsyncClient) -> None:
        inside = [asyncio.create_task(client.post("/v1/inference", json={"input_ids": [i], "max_new_tokens": 2})) for i in (1, 2)]
        await until(lambda: backend.in_flight == 2)
        refused = await client.post("/v1/inference", json={"input_ids": [3], "max_new_tokens": 2})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "overloaded"
        assert int(refused.headers["Retry-After"]) >= 1
        gate.gate.set()
        assert [r.status_code for r in await asyncio.gather(*inside)] == [200, 200]

    run(app, scenario)


def test_a_failing_step_fails_its_requests_with_500_frees_their_blocks_and_the_server_goes_on(oracle) -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate, engine = gated[0], app.state.engine

    async def scenario(client: httpx.AsyncClient) -> None:
        gate.fail = True
        failed = await client.post("/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 5})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "batch_failed"
        gate.fail = False
        ok = await client.post("/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 5})
        assert ok.status_code == 200 and ok.json()["output_ids"] == oracle([1, 2, 3], 5)
        assert engine.scheduler.manager.used_blocks == 0 and engine.failed_steps == 1

    run(app, scenario)


def test_a_request_past_its_deadline_gets_504_and_its_blocks_back_within_one_step() -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate, engine = gated[0], app.state.engine
    gate.gate.clear()

    async def scenario(client: httpx.AsyncClient) -> None:
        # Submitted straight to the engine with a deadline already past, beside a request that has none.
        expired = engine.submit(Sequence(list(range(1, 40)), 50, deadline=time.perf_counter()))
        alive = asyncio.create_task(client.post("/v1/inference", json={"input_ids": [4, 5], "max_new_tokens": 3}))
        gate.gate.set()
        finished = await expired.result
        assert finished.error is not None and finished.error.status == 504
        assert (await alive).status_code == 200
        assert engine.scheduler.manager.used_blocks == 0 and engine.scheduler.stats.aborted == 1

    run(app, scenario)


def test_the_server_wide_deadline_flag_turns_a_long_request_into_504() -> None:
    gated: list[GatedModel] = []
    app = build_app(settings(request_timeout_s=0.05), wrap_model=lambda m: gated.append(GatedModel(m)) or gated[0])
    gate = gated[0]
    gate.gate.clear()
    backend = app.state.backend

    async def scenario(client: httpx.AsyncClient) -> None:
        late = asyncio.create_task(client.post("/v1/inference", json={"input_ids": [1, 2], "max_new_tokens": 5}))
        await until(lambda: backend.in_flight == 1)
        await asyncio.sleep(0.1)  # the deadline itself is time: let 50 ms pass before the engine moves
        gate.gate.set()
        answer = await late
        assert answer.status_code == 504 and answer.json()["error"]["type"] == "deadline_exceeded"

    run(app, scenario)
