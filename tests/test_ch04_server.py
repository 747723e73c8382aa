"""Chapter 4's server: one ledger of KV memory, a full queue answers 429, sustained pressure goes to the CPU fallback.

In-process tests run the app on the test's own event loop (httpx's ASGI transport, the lifespan
entered by hand), with batch runners that hold their batch until the test lets it go: the queue and
the pool stay full exactly as long as the test wants, and the test waits for states, never for time.
A last test starts the real server and overloads it with real requests.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import requests
from asgi_helpers import serving, until

from chapters.ch02_fastapi_async.api import Generated
from chapters.ch04_memory_pool.server import PoolSettings, build_app
from shared.schemas import ValidRequest

N_CTX = 512  # the default model's context


class HeldRunner:
    """Answers each request with its first token repeated, but only once the test opens the gate.

    With ``pool``, each batch first takes a whole-context range of that pool per request, as a real
    batch takes its range, and returns it after: the pool is as full as the test makes it.
    """

    def __init__(self, pool=None) -> None:
        self.gate = threading.Event()
        self.pool = pool
        self.batches: list[list[int]] = []

    def __call__(self, requests: list[ValidRequest]) -> list[Generated]:
        self.batches.append([r.input_ids[0] for r in requests])
        cache = self.pool.new_cache(len(requests), N_CTX) if self.pool is not None else None
        try:
            self.gate.wait(timeout=60)
        finally:
            if cache is not None:
                cache.close()
        return [Generated([r.input_ids[0]] * r.max_new_tokens, {"batch": 0.0}) for r in requests]


def settings(**overrides) -> PoolSettings:
    base = {"weights": "default", "device": "cpu", "min_batch": 1, "max_batch": 1, "window_ms": 0.0, "fallback_slots": 0}
    return PoolSettings(**{**base, **overrides})


def post(client: httpx.AsyncClient, first: int, new_tokens: int = 3):
    return client.post("/v1/inference", json={"input_ids": [first, 1, 2], "max_new_tokens": new_tokens})


def test_a_full_queue_rejects_with_429_and_never_a_5xx() -> None:
    runner = HeldRunner()
    app = build_app(settings(max_queue=2), run_batch=runner)  # one on the device, two may wait, the fourth is refused
    backend = app.state.backend

    async def scenario(client: httpx.AsyncClient) -> None:
        try:
            inside = [asyncio.create_task(post(client, 1))]
            await until(lambda: runner.batches == [[1]])  # the first is on the device ...
            inside += [asyncio.create_task(post(client, first)) for first in (2, 3)]
            await until(lambda: backend.batcher.queued == 2)  # ... two wait behind it
            rejected = await post(client, 4)
            assert rejected.status_code == 429
            assert rejected.json()["error"]["type"] == "overloaded"
            assert int(rejected.headers["Retry-After"]) >= 1
        finally:
            runner.gate.set()
        responses = await asyncio.gather(*inside)
        assert [r.status_code for r in responses] == [200] * 3
        assert [r.json()["output_ids"] for r in responses] == [[first] * 3 for first in (1, 2, 3)]
        stats = (await client.get("/stats")).json()
        assert stats["admission"]["rejected_total"] == 1 and stats["admission"]["in_flight"] == 0
        assert stats["pool"]["blocks_used"] == 0

    asyncio.run(serving(app, scenario))


def test_sustained_pressure_serves_new_requests_on_the_cpu_fallback_with_the_oracles_tokens(oracle) -> None:
    # A pool of one context: a held batch of one fills it; one waiting place; pressure counts at once; one fallback slot.
    app = build_app(settings(pool_tokens=N_CTX, max_queue=1, fallback_after_s=0.0, fallback_slots=1))
    backend = app.state.backend
    runner = HeldRunner(backend.runner.pool)
    backend.batcher._run_batch = runner  # hold the pool full with a batch of our own
    prompt, new_tokens = [51, 52, 43, 52, 53, 61], 12

    async def scenario(client: httpx.AsyncClient) -> None:
        try:
            held = [asyncio.create_task(post(client, 7))]
            await until(lambda: backend.runner.pool.stats().use == 1.0)
            held.append(asyncio.create_task(post(client, 8)))
            await until(lambda: backend.batcher.queued == 1)  # the queue is full too
            offloaded = await client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": new_tokens})
            assert offloaded.status_code == 200, offloaded.text
            assert offloaded.json()["output_ids"] == oracle(prompt, new_tokens)
            assert "fallback" in offloaded.json()["timings_ms"]
            stats = (await client.get("/stats")).json()["admission"]
            assert stats["fallback_served_total"] == 1 and stats["under_pressure"]
        finally:
            runner.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]

    asyncio.run(serving(app, scenario))


class ExplodingDecode:
    """The model, whose decode raises after the prompt pass: a batch that fails with its pool range taken."""

    def __init__(self, model) -> None:
        self.model = model
        self.config, self.device, self.dtype = model.config, model.device, model.dtype

    def prefill(self, *args):
        return self.model.prefill(*args)

    def decode(self, *args):
        raise RuntimeError("boom in decode")


def test_a_failed_batch_and_a_client_gone_mid_batch_leave_nothing_reserved_and_the_next_request_is_served(oracle) -> None:
    app = build_app(settings())
    backend = app.state.backend
    model = backend.runner.model

    async def scenario(client: httpx.AsyncClient) -> None:
        backend.runner.model = ExplodingDecode(model)
        failed = await post(client, 5)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "batch_failed"
        stats = (await client.get("/stats")).json()
        assert stats["pool"]["blocks_used"] == 0 and stats["admission"]["in_flight"] == 0

        backend.runner.model = model
        gate = threading.Event()
        real_run = backend.batcher._run_batch

        def slow_run(batch):
            gate.wait(timeout=60)
            return real_run(batch)

        backend.batcher._run_batch = slow_run
        leaving = asyncio.create_task(post(client, 6, new_tokens=8))
        await until(lambda: backend.batcher.stats.batches == 2)  # its batch is on the device
        leaving.cancel()  # the client leaves mid-batch
        await asyncio.gather(leaving, return_exceptions=True)
        gate.set()
        await until(lambda: backend.runner.pool.stats().blocks_used == 0 and backend.admission.stats()["in_flight"] == 0)
        backend.batcher._run_batch = real_run
        served = await client.post("/v1/inference", json={"input_ids": [5, 6, 7], "max_new_tokens": 4})
        assert served.status_code == 200 and served.json()["output_ids"] == oracle([5, 6, 7], 4)

    asyncio.run(serving(app, scenario))


def test_a_batch_reserves_exactly_its_padded_range_and_counts_what_it_wrote(oracle) -> None:
    app = build_app(settings(max_batch=4, min_batch=4, window_ms=1000.0))
    backend = app.state.backend
    prompts, new_tokens = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], [5, 2]

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*[
            client.post("/v1/inference", json={"input_ids": p, "max_new_tokens": n}) for p, n in zip(prompts, new_tokens)
        ])
        assert [a.json()["output_ids"] for a in answers] == [oracle(p, n) for p, n in zip(prompts, new_tokens)]

    backend.batcher.config = backend.batcher.config.__class__(max_batch=2, min_batch=2, window_s=1.0)
    asyncio.run(serving(app, scenario))
    pool = backend.runner.stats()
    # One batch of 2 rows x (7 prompt + 5 new - 1) = 22 slots, rounded up to two 16-slot blocks.
    assert pool["slots_reserved_total"] == 32
    assert pool["slots_written_total"] == (3 + 5 - 1) + (7 + 2 - 1)


def test_the_pool_is_sized_by_the_articles_rule_and_the_server_refuses_a_pool_too_small() -> None:
    app = build_app(settings(max_concurrency=5, pool_headroom=1.2, block_tokens=16))
    pool = app.state.backend.runner.pool
    assert pool.capacity_tokens == 3072  # 512 x 5 x 1.2, already a whole number of 16-token blocks
    assert pool.storage.shape == (4, 2, pool.capacity_tokens, 256)
    with pytest.raises(ValueError):
        build_app(settings(pool_tokens=N_CTX - 1))


def test_the_real_server_under_overload_answers_200_or_429_and_the_right_tokens(server, oracle) -> None:
    """A tiny pool and queue (one request at a time, one waiting) and ten clients at once: no crash, no 5xx."""
    tiny_pool = ("--pool-tokens", str(N_CTX), "--max-queue", "1", "--fallback-slots", "0", "--max-batch", "1", "--min-batch", "1")
    prompts = [[10 + i, 20, 30 + i, 40] for i in range(10)]
    with server("ch04", *tiny_pool) as running:

        def send(prompt: list[int]) -> requests.Response:
            return requests.post(f"{running.url}/v1/inference", json={"input_ids": prompt, "max_new_tokens": 48}, timeout=120)

        with ThreadPoolExecutor(len(prompts)) as clients:
            responses = list(clients.map(send, prompts))
        stats = requests.get(f"{running.url}/stats", timeout=10).json()
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    for prompt, response in zip(prompts, responses):
        if response.status_code == 200:
            assert response.json()["output_ids"] == oracle(prompt, 48)
        else:
            assert int(response.headers["Retry-After"]) >= 1
    assert stats["admission"]["rejected_total"] == statuses.count(429)
    assert stats["pool"]["blocks_used"] == 0 and stats["admission"]["in_flight"] == 0
