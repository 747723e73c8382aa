"""Graded tests of chapter 7's exercises: the deadline (ch07.1), the drain (ch07.2), the unload (ch07.3), the leak's fix (ch07.4).

The oracles are plain arithmetic and bookkeeping: the deadline is the smaller of two numbers, a
drain's report counts what was still in flight, an unload leaves no reference behind, and the
leak's fix leaves the per-request table empty whatever the outcome. Nothing waits on a wall clock
except the two bounded waits whose expiry is the point (a drain timeout, a forced unload).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from chapters.ch07_production.deadlines import effective_timeout
from chapters.ch07_production.drain import DrainController
from chapters.ch07_production.model_registry import ModelRegistry, ModelVersion, Unloaded
from chapters.ch07_production.server import ProductionSettings, build_app
from shared.schemas import ApiError

# ----------------------------------------------------------------------------- ch07.1: the deadline


@pytest.mark.exercise("ch07.1")
@pytest.mark.parametrize(("server_s", "header", "expected"), [
    (60.0, None, 60.0),
    (60.0, "", 60.0),
    (60.0, "  ", 60.0),
    (60.0, "2.5", 2.5),
    (60.0, "0.001", 0.001),
    (60.0, "60", 60.0),
    (60.0, "600", 60.0),  # never longer than the server's
    (5.0, "1e9", 5.0),
])
def test_the_client_may_shorten_the_deadline_never_lengthen_it(server_s: float, header: str | None, expected: float) -> None:
    assert effective_timeout(server_s, header) == pytest.approx(expected)


@pytest.mark.exercise("ch07.1")
@pytest.mark.parametrize("header", ["abc", "-1", "0", "-0.0", "nan", "NaN", "inf", "-inf", "1s"])
def test_a_header_that_is_not_a_positive_finite_number_is_a_422_naming_the_header(header: str) -> None:
    with pytest.raises(ApiError) as raised:
        effective_timeout(60.0, header)
    assert raised.value.status == 422 and raised.value.type == "invalid_request"
    assert "X-Request-Timeout-S" in raised.value.message


# ----------------------------------------------------------------------------- ch07.2: the drain


async def turns(task: asyncio.Task, n: int = 20) -> None:
    """Let ``task`` and the others run ``n`` times (no wall clock); re-raise at once if ``task`` failed."""
    for _ in range(n):
        await asyncio.sleep(0)
    if task.done():
        task.result()  # a failure here (an unwritten exercise) is the test's answer, not a later assertion


@pytest.mark.exercise("ch07.2")
def test_a_drain_refuses_new_work_at_once_and_ends_when_the_last_request_is_answered() -> None:
    async def scenario() -> None:
        drain = DrainController(timeout_s=30.0, retry_after_s=3)
        drain.enter()
        drain.enter()
        draining = asyncio.create_task(drain.drain())
        await turns(draining)
        assert drain.draining, "the flag flips before the wait starts"
        with pytest.raises(ApiError) as refused:
            drain.enter()
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "3"}
        assert drain.in_flight == 2, "a refused request is not counted"
        drain.exit()
        await turns(draining)
        assert not draining.done(), "one request is still in flight"
        drain.exit()
        report = await asyncio.wait_for(draining, 5.0)
        assert report.cut_off == 0 and report.waited_s < 5.0

    asyncio.run(scenario())


@pytest.mark.exercise("ch07.2")
def test_an_idle_server_drains_at_once() -> None:
    async def scenario() -> None:
        drain = DrainController(timeout_s=30.0)
        report = await asyncio.wait_for(drain.drain(), 5.0)
        assert drain.draining and report.cut_off == 0 and report.waited_s < 5.0

    asyncio.run(scenario())


@pytest.mark.exercise("ch07.2")
def test_a_drain_gives_up_at_its_timeout_and_counts_what_it_cut_off() -> None:
    async def scenario() -> None:
        drain = DrainController(timeout_s=0.05)
        for _ in range(3):
            drain.enter()
        report = await asyncio.wait_for(drain.drain(), 5.0)
        assert report.cut_off == 3
        assert 0.05 <= report.waited_s < 5.0

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- ch07.3: the unload


class FakeBackend:
    """Stands in for a version's backend: records that it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


@pytest.mark.exercise("ch07.3")
def test_a_retired_version_unloads_when_its_last_request_is_done_not_before() -> None:
    async def scenario() -> None:
        registry = ModelRegistry(max_unload_wait_s=30.0)
        backend = FakeBackend()
        old = ModelVersion("v1", None, backend)
        registry.versions["v1"] = old
        with old.use():
            retiring = asyncio.create_task(registry.retire(old))
            await turns(retiring)
            assert old.retired and not retiring.done() and not backend.closed, "a request still uses v1"
            assert "v1" in registry.versions
        outcome = await asyncio.wait_for(retiring, 5.0)
        assert outcome == Unloaded("v1", forced=False, cut_off=0)
        assert backend.closed and "v1" not in registry.versions
        assert old.backend is None and old.loaded is None, "every reference to the weights and the pool is dropped"
        assert registry.unloaded == [outcome]

    asyncio.run(scenario())


@pytest.mark.exercise("ch07.3")
def test_an_idle_version_unloads_at_once() -> None:
    async def scenario() -> None:
        registry = ModelRegistry(max_unload_wait_s=30.0)
        backend = FakeBackend()
        registry.versions["v1"] = version = ModelVersion("v1", None, backend)
        outcome = await asyncio.wait_for(registry.retire(version), 5.0)
        assert outcome == Unloaded("v1", forced=False, cut_off=0) and backend.closed

    asyncio.run(scenario())


@pytest.mark.exercise("ch07.3")
def test_a_version_that_never_drains_is_unloaded_anyway_after_the_maximum_wait() -> None:
    async def scenario() -> None:
        registry = ModelRegistry(max_unload_wait_s=0.05)
        backend = FakeBackend()
        stuck = ModelVersion("v1", None, backend)
        registry.versions["v1"] = stuck
        with stuck.use(), stuck.use():
            outcome = await asyncio.wait_for(registry.retire(stuck), 5.0)
            assert outcome == Unloaded("v1", forced=True, cut_off=2)
            assert backend.closed and "v1" not in registry.versions and stuck.backend is None

    asyncio.run(scenario())


# ----------------------------------------------------------------------------- ch07.4: the leak's fix


def fixed_lesson_settings() -> ProductionSettings:
    return ProductionSettings(weights="default", device="cpu", engine="eager", precision="fp32", tuned_config="none",
                              fallback_slots=0, pool_tokens=4 * 512, probe_interval_s=3600, leak_lesson="fixed")


@pytest.mark.exercise("ch07.4")
def test_the_fixed_lesson_releases_the_intermediate_on_success_and_on_every_failure(oracle) -> None:
    app = build_app(fixed_lesson_settings())
    staging = app.state.production.staging

    async def scenario(client: httpx.AsyncClient) -> None:
        ok = await client.post("/v1/inference", json={"input_ids": [5, 6, 7], "max_new_tokens": 3})
        assert ok.status_code == 200, ok.text
        assert ok.json()["output_ids"] == oracle([5, 6, 7], 3)
        assert staging == {}, "a served request left its intermediate behind"
        for _ in range(3):
            late = await client.post("/v1/inference", json={"input_ids": [5, 6, 7], "max_new_tokens": 3},
                                     headers={"X-Request-Timeout-S": "0.000001"})
            assert late.status_code == 504, late.text
        assert staging == {}, f"{len(staging)} failed requests left their intermediate behind"

    async def run() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ch07", timeout=60) as client:
                await scenario(client)

    asyncio.run(run())
