"""Chapter 8 as a real process inside chapter 7's shell: SIGTERM with streams open, hot reload under streaming load.

Both run ``python -m chapters.ch08_continuous_batching`` on loopback and stop it when done. The
clients are asyncio streams (httpx); a stream counts as answered only when its ``done`` event came
with the oracle's tokens.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import psutil
import pytest
import requests

from benchmarks.harness.server_process import running_module

MODULE = "chapters.ch08_continuous_batching"
BASE_ARGS = ["--device", "cpu", "--precision", "fp32", "--attention", "gather", "--max-num-seqs", "64",
             "--max-num-batched-tokens", "256", "--probe-interval-s", "3600", "--torch-threads", "1"]
PROMPT = [5, 6, 7, 8]


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll another process's state (there is no event to await across processes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


async def stream_once(client: httpx.AsyncClient, prompt: list[int], new_tokens: int, first_token: asyncio.Event | None = None) -> list[int]:
    """One streamed request; its output ids from the ``done`` event (an ``error`` event or a cut stream raises)."""
    body = {"input_ids": prompt, "max_new_tokens": new_tokens, "stream": True}
    async with client.stream("POST", "/v1/inference", json=body) as response:
        assert response.status_code == 200, await response.aread()
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
                if event == "token" and first_token is not None:
                    first_token.set()
            elif line.startswith("data: ") and event in ("done", "error"):
                data = json.loads(line.removeprefix("data: "))
                assert event == "done", data
                return data["output_ids"]
    raise AssertionError("the stream ended without a done event")


@pytest.mark.slow  # make test-slow: chapter 7's drain under SIGTERM runs on every run (test_ch07_*)
def test_sigterm_with_64_streams_open_finishes_every_stream_and_exits_within_the_drain_timeout(oracle) -> None:
    drain_s = 30
    with running_module(MODULE, [*BASE_ARGS, "--drain-timeout-s", str(drain_s)], name="ch08") as server:
        wait_until(lambda: requests.get(f"{server.url}/readyz", timeout=5).status_code == 200, 60, "readiness")

        async def scenario() -> tuple[list, float]:
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
                started = [asyncio.Event() for _ in range(64)]
                streams = [asyncio.create_task(stream_once(client, [1 + i, 2, 3], 48, started[i])) for i in range(64)]
                await asyncio.gather(*(e.wait() for e in started))  # every stream is open and producing
                server.process.send_signal(signal.SIGTERM)
                sent_at = time.monotonic()
                results = await asyncio.gather(*streams, return_exceptions=True)
                await asyncio.to_thread(server.process.wait, drain_s + 15)
                return results, time.monotonic() - sent_at

        results, exit_after = asyncio.run(scenario())
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, f"{len(failures)} streams failed: {failures[:3]}\n{server.log_tail(2000)}"
        assert results == [oracle([1 + i, 2, 3], 48) for i in range(64)]
        assert exit_after < drain_s, server.log_tail(2000)
        assert server.process.returncode in (0, -signal.SIGTERM), server.log_tail(2000)


@pytest.mark.slow
def test_hot_reload_under_streaming_load_fails_nothing_and_gives_the_old_versions_memory_back(oracle) -> None:
    with running_module(MODULE, [*BASE_ARGS, "--admin-token", "secret", "--max-unload-wait-s", "60"], name="ch08") as server:
        wait_until(lambda: requests.get(f"{server.url}/readyz", timeout=5).status_code == 200, 60, "readiness")
        process = psutil.Process(server.process.pid)
        one_version_rss = process.memory_info().rss
        stop, progress = asyncio.Event(), asyncio.Event()
        answered: list[list[int]] = []

        async def load(client: httpx.AsyncClient, index: int) -> None:
            while not stop.is_set():
                prompt = [1 + index, 2, 3]
                assert await stream_once(client, prompt, 16) == oracle(prompt, 16)
                answered.append(prompt)
                progress.set()

        async def until_answered(count: int) -> None:
            while len(answered) < count:
                progress.clear()
                await progress.wait()

        async def scenario() -> tuple[int, int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                clients = [asyncio.create_task(load(client, i)) for i in range(16)]
                await until_answered(32)
                reload = await client.post("/admin/models", json={"version": "v2", "weights": "default"},
                                           headers={"Authorization": "Bearer secret"})
                assert reload.status_code == 201, reload.text
                two_versions_rss = process.memory_info().rss
                seen = len(answered)
                await until_answered(seen + 32)  # the load goes on, on the new version
                stop.set()
                await asyncio.gather(*clients)
                return two_versions_rss, seen

        two_versions_rss, _ = asyncio.run(scenario())
        stats = lambda: requests.get(f"{server.url}/stats", timeout=5).json()  # noqa: E731
        wait_until(lambda: [u["name"] for u in stats()["unloaded"]] == ["v1"], 60, "v1 unloaded")
        assert stats()["unloaded"][0]["forced"] is False
        after_rss = process.memory_info().rss
        grown = two_versions_rss - one_version_rss
        assert grown > 0, "a second version loaded and its pool allocated should cost memory"
        # The old version's pool and weights are returned to the operating system, not just unreferenced.
        assert after_rss < two_versions_rss - grown / 2, (
            f"RSS {one_version_rss / 2**20:.0f} MiB with one version, {two_versions_rss / 2**20:.0f} with two, "
            f"{after_rss / 2**20:.0f} after v1 unloaded")
