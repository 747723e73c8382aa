"""Chapter 4's server under a full pool: requests queue, then get 429 with Retry-After, or go to the CPU fallback.

In-process tests run the app on the test's own event loop (httpx's ASGI transport, the lifespan
entered by hand), with a batch runner that holds its batch until the test lets it go: the pool stays
full exactly as long as the test wants, and the test waits for states, never for time.
A last test starts the real server with a tiny pool and overloads it with real requests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import requests

from chapters.ch02_fastapi_async.api import Generated
from chapters.ch04_memory_pool.server import PoolSettings, build_app
from shared.schemas import ValidRequest

N_CTX = 512  # the default model's context: what one request reserves


class HeldRunner:
    """Answers each request with its first token repeated, but only once the test opens the gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def __call__(self, requests: list[ValidRequest]) -> list[Generated]:
        self.gate.wait(timeout=60)
        return [Generated([r.input_ids[0]] * r.max_new_tokens, {"batch": 0.0}) for r in requests]


def settings(**overrides) -> PoolSettings:
    base = {"weights": "default", "device": "cpu", "min_batch": 1, "max_batch": 1, "window_ms": 0.0, "fallback_slots": 0}
    return PoolSettings(**{**base, **overrides})


async def until(condition: Callable[[], bool], max_turns: int = 100_000) -> None:
    """Yield to the event loop until ``condition`` holds (a state change, not a timer)."""
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the server never reached the expected state")


async def run_with_app(app, scenario) -> None:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ch04") as client:
            await scenario(client)


def post(client: httpx.AsyncClient, first: int, new_tokens: int = 3):
    return client.post("/v1/inference", json={"input_ids": [first, 1, 2], "max_new_tokens": new_tokens})


def test_a_full_pool_queues_then_rejects_with_429_and_never_a_5xx() -> None:
    runner = HeldRunner()
    # Two reservations fit (2 x 512 slots), two more may wait, the fifth is turned away.
    app = build_app(settings(pool_tokens=2 * N_CTX, max_queue=2), run_batch=runner)
    admission = app.state.admission

    async def scenario(client: httpx.AsyncClient) -> None:
        try:
            inside = [asyncio.create_task(post(client, first)) for first in (1, 2, 3, 4)]
            await until(lambda: admission.stats()["admitted"] == 2 and admission.stats()["waiting"] == 2)
            stats = (await client.get("/stats")).json()
            assert stats["admission"]["reserved_use"] == 1.0
            assert stats["pool"]["blocks_total"] == 2 * stats["pool"]["reservation_blocks"]

            rejected = await post(client, 5)
            assert rejected.status_code == 429
            assert rejected.json()["error"]["type"] == "overloaded"
            assert int(rejected.headers["Retry-After"]) >= 1
        finally:
            runner.gate.set()
        responses = await asyncio.gather(*inside)
        assert [r.status_code for r in responses] == [200] * 4
        assert [r.json()["output_ids"] for r in responses] == [[first] * 3 for first in (1, 2, 3, 4)]
        stats = (await client.get("/stats")).json()
        assert stats["admission"]["rejected_total"] == 1 and stats["admission"]["waited_total"] == 2
        assert stats["admission"]["reserved_blocks"] == 0 and stats["pool"]["blocks_used"] == 0

    asyncio.run(run_with_app(app, scenario))


def test_sustained_pressure_serves_new_requests_on_the_cpu_fallback_with_the_oracles_tokens(oracle) -> None:
    runner = HeldRunner()
    # One reservation fills the pool, no waiting place, pressure counts from the first moment, one fallback slot.
    app = build_app(settings(pool_tokens=N_CTX, max_queue=0, fallback_after_s=0.0, fallback_slots=1), run_batch=runner)
    admission = app.state.admission
    prompt, new_tokens = [51, 52, 43, 52, 53, 61], 12

    async def scenario(client: httpx.AsyncClient) -> None:
        try:
            held = asyncio.create_task(post(client, 7))
            await until(lambda: admission.stats()["admitted"] == 1)
            offloaded = await client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": new_tokens})
            assert offloaded.status_code == 200, offloaded.text
            assert offloaded.json()["output_ids"] == oracle(prompt, new_tokens)
            assert "fallback" in offloaded.json()["timings_ms"]
            stats = (await client.get("/stats")).json()["admission"]
            assert stats["fallback_served_total"] == 1 and stats["under_pressure"]
        finally:
            runner.gate.set()
        assert (await held).status_code == 200

    asyncio.run(run_with_app(app, scenario))


def test_the_pool_is_sized_by_the_articles_rule_and_the_server_refuses_a_pool_too_small() -> None:
    app = build_app(settings(max_concurrency=5, pool_headroom=1.2, block_tokens=16))
    pool = app.state.pool
    assert pool.capacity_tokens == 3072  # 512 x 5 x 1.2, already a whole number of 16-token blocks
    assert pool.storage.shape == (4, 2, pool.capacity_tokens, 256)
    with pytest.raises(ValueError):
        build_app(settings(pool_tokens=N_CTX - 1))


def test_the_real_server_under_overload_answers_200_or_429_and_the_right_tokens(server, oracle) -> None:
    """A tiny pool (one request at a time, one waiting) and ten clients at once: no crash, no 5xx."""
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
    assert stats["pool"]["blocks_used"] == 0 and stats["admission"]["reserved_blocks"] == 0
