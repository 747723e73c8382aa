"""Stopping chapter 9 under load loses no accepted request (chapters/ch09_scale_out/stopping.py).

The real processes: ``python -m chapters.ch09_scale_out`` with two replicas, requests in flight at
both (streamed and whole, long answers), then SIGTERM. The oracle for an answer is the reference
model's greedy tokens; the contract's 503 is chapter 7's (JSON ``error``, ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.harness.server_process import running_module

MODULE = "chapters.ch09_scale_out"
DRAIN_TIMEOUT_S = 60
ARGS = ["--num-replicas", "2", "--spare-replicas", "0", "--replica-cpus", "0.5", "--device", "cpu", "--precision", "fp32", "--attention", "gather",
        "--torch-threads", "1", "--max-num-seqs", "16", "--max-queue", "8", "--probe-interval-s", "3600",
        "--drain-timeout-s", str(DRAIN_TIMEOUT_S)]
NEW_TOKENS = 128  # long enough that every answer is mid-way when the signal lands
LONG_TOKENS = 256  # serve run's own stop is quick: answers that outlast it, on one replica of the toy
PROBE_PACE_S = 0.05  # pacing of the probe loop (not a wait for anything): keeps it from starving the replicas


async def _whole(client: httpx.AsyncClient, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    response = await client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": new_tokens})
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


async def _stream(client: httpx.AsyncClient, prompt: list[int], first_token: asyncio.Event, new_tokens: int = NEW_TOKENS) -> list[int]:
    body = {"input_ids": prompt, "max_new_tokens": new_tokens, "stream": True}
    tokens, event, done = [], None, False
    async with client.stream("POST", "/v1/inference", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "token":
                tokens.append(json.loads(line.removeprefix("data: "))["token_id"])
                first_token.set()
            elif line.startswith("data: ") and event == "done":
                done = True
    assert done, f"the stream ended without its done event after {len(tokens)} tokens"
    return tokens


def _assert_contract_503(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "draining"


async def _probe_until_refused(url: str, answers_done: asyncio.Event, seen: list[tuple[str, bool]]) -> None:
    """Ask once at a time until the proxy is gone (connection refused or closed); records (outcome, whether every answer was done by then)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while True:
            try:
                response = await client.post("/v1/inference", json={"input_ids": [1, 2, 3], "max_new_tokens": 2})
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):  # the proxy has stopped
                seen.append(("gone", answers_done.is_set()))
                return
            if response.status_code == 503:
                _assert_contract_503(response)
            seen.append((str(response.status_code), answers_done.is_set()))
            await asyncio.sleep(PROBE_PACE_S)


@pytest.mark.slow
def test_sigterm_under_load_answers_every_accepted_request_then_refuses_with_503_then_stops(oracle) -> None:
    prompts = [list(range(10 + i, 26 + i)) for i in range(8)]
    with running_module(MODULE, ARGS, name="ch09-drain", startup_timeout_s=300) as server:

        async def run():
            first_tokens = [asyncio.Event() for _ in prompts[1::2]]
            answers_done, probes = asyncio.Event(), []
            async with httpx.AsyncClient(base_url=server.url, timeout=DRAIN_TIMEOUT_S + 60) as client:
                # the whole answers are asked first; the streams after them, and each has a token before the signal
                wholes = [asyncio.create_task(_whole(client, p)) for p in prompts[0::2]]
                streams = [asyncio.create_task(_stream(client, p, e)) for p, e in zip(prompts[1::2], first_tokens, strict=True)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 120)
                server.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                prober = asyncio.create_task(_probe_until_refused(server.url, answers_done, probes))
                answers = await asyncio.gather(*wholes, *streams)
                answers_done.set()
                await asyncio.wait_for(prober, DRAIN_TIMEOUT_S + 60)
            return answers, probes, signalled

        answers, probes, signalled = asyncio.run(run())
        try:
            server.process.wait(timeout=DRAIN_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {DRAIN_TIMEOUT_S + 60} s after its answers:\n{server.log_tail()}")
        stopped_after_s = time.monotonic() - signalled
        log = server.log_tail(20000)

    for prompt, answer in zip([*prompts[0::2], *prompts[1::2]], answers, strict=True):
        assert answer == oracle(prompt, NEW_TOKENS)  # whole and complete, though the signal came mid-answer
    outcomes = [outcome for outcome, _ in probes]
    assert "503" in outcomes, f"nothing was refused while draining: {probes}\n{log}"
    # accepted at first (the edge learns of the drain a moment after the signal), then refused, then gone
    first_503 = outcomes.index("503")
    assert set(outcomes[:first_503]) <= {"200"} and set(outcomes[first_503:-1]) == {"503"}, probes
    assert outcomes[-1] == "gone" and probes[-1][1], f"the proxy went before every answer was sent: {probes}"
    assert server.process.returncode == 0, log
    assert stopped_after_s < DRAIN_TIMEOUT_S + 60, stopped_after_s


class _Remote:
    def __init__(self, method) -> None:
        self.method = method

    def remote(self, *args):
        return self.method(*args)


class _StandInSignal:
    """The drain signal's methods as the edge calls them (``.remote`` returns an awaitable), without Ray."""

    def __init__(self) -> None:
        self.draining, self.idle_reports = asyncio.Event(), []

        async def register(edge_id):
            return self.draining.is_set()

        async def wait_draining():
            await self.draining.wait()

        self.register, self.wait_draining = _Remote(register), _Remote(wait_draining)
        self.report_idle = _Remote(self.idle_reports.append)


def test_the_edge_refuses_with_503_once_draining_and_reports_idle_only_when_its_last_request_finished(monkeypatch) -> None:
    from chapters.ch09_scale_out import stopping

    signal_ = _StandInSignal()
    monkeypatch.setattr(stopping, "drain_signal", lambda: signal_)
    monkeypatch.setattr(stopping.ray, "is_initialized", lambda: True)  # as inside Serve's proxy
    release, entered = asyncio.Event(), asyncio.Event()

    async def app(scope, receive, send) -> None:  # the proxy and a replica, answering once released
        entered.set()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"answer", "more_body": False})

    async def call(edge) -> list[dict]:
        sent = []

        async def send(message):
            sent.append(message)

        await edge({"type": "http", "method": "POST", "path": "/v1/inference"}, None, send)
        return sent

    async def run():
        edge = stopping.DrainAtTheEdge(app)
        accepted = asyncio.create_task(call(edge))
        await entered.wait()
        signal_.draining.set()
        while not edge.draining:  # the edge's watcher runs on the next turns of the loop
            await asyncio.sleep(0)
        refused = await call(edge)
        assert signal_.idle_reports == []  # one request still in flight
        release.set()
        return edge, await accepted, refused

    edge, accepted, refused = asyncio.run(run())
    assert accepted[0]["status"] == 200 and accepted[1]["body"] == b"answer"
    start, body = refused
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"1" and headers[b"content-type"] == b"application/json"
    assert re.fullmatch(rb"[0-9a-f]{32}", headers[b"x-request-id"])  # every answer names itself, a refusal too
    assert json.loads(body["body"])["error"]["type"] == "draining"
    assert signal_.idle_reports == [edge.edge_id]


def test_the_drain_signal_waits_for_every_edge_registered_before_the_drain_and_no_other() -> None:
    from chapters.ch09_scale_out.stopping import DrainState

    async def run():
        state = DrainState()
        assert await state.wait_drained(start_within_s=0.01, timeout_s=1) is False  # a worker's preStop, no drain: it returns
        assert await state.register("a") is False and await state.register("b") is False
        assert await state.start() == 2
        assert await state.register("late") is True  # registered during the drain: it passes nothing on
        assert await state.wait_idle(timeout_s=0.01) == ["a", "b"]  # the timeout runs out: both still busy
        await state.report_idle("a")
        follower = asyncio.create_task(state.wait_drained(start_within_s=1, timeout_s=60))
        await state.report_idle("b")
        assert await state.wait_idle(timeout_s=60) == []
        assert await follower is True

    asyncio.run(run())


def test_waiting_for_idle_edges_returns_only_when_the_last_one_reports() -> None:
    from chapters.ch09_scale_out.stopping import DrainState

    async def run():
        state = DrainState()
        await state.register("a")
        await state.register("b")
        await state.start()
        waiting = asyncio.create_task(state.wait_idle(timeout_s=60))
        await asyncio.sleep(0)  # the waiter runs up to its wait
        await state.report_idle("a")
        await asyncio.sleep(0)
        assert not waiting.done()  # "b" still has requests in flight
        await state.report_idle("b")
        assert await asyncio.wait_for(waiting, 5) == []

    asyncio.run(run())


def test_an_edge_with_nothing_in_flight_when_the_drain_starts_reports_idle_at_once(monkeypatch) -> None:
    from chapters.ch09_scale_out import stopping

    signal_ = _StandInSignal()
    monkeypatch.setattr(stopping, "drain_signal", lambda: signal_)
    monkeypatch.setattr(stopping.ray, "is_initialized", lambda: True)

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"answer", "more_body": False})

    async def run():
        edge = stopping.DrainAtTheEdge(app)

        async def send(message):
            pass

        await edge({"type": "http", "method": "POST", "path": "/v1/inference"}, None, send)  # registers, answers
        signal_.draining.set()
        while not edge.draining:
            await asyncio.sleep(0)
        return edge

    edge = asyncio.run(run())
    assert signal_.idle_reports == [edge.edge_id]  # nothing in flight: the drain must not wait for this edge


def test_the_drain_command_gives_up_within_its_bound_when_no_cluster_answers(tmp_path) -> None:
    # an address where nothing listens: joining would retry far longer than a pod's grace period
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "chapters.ch09_scale_out.stopping", "--address", "127.0.0.1:9",
                           "--connect-timeout-s", "3", "--timeout-s", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_TMPDIR": str(tmp_path)})
    assert done.returncode != 0
    assert time.monotonic() - started < 60  # 4 s of bound plus Ray's import, never the grace period's 45


@pytest.mark.slow
def test_serve_run_stopped_as_the_readme_says_answers_every_accepted_request(oracle, tmp_path) -> None:
    """The README's way to stop `serve run`: the drain command first, then SIGTERM. Every answer in flight comes back whole."""
    from pathlib import Path

    import yaml

    import chapters.ch09_scale_out  # noqa: F401  (sets, in this process's environment, what `serve run` needs before Ray starts)
    from benchmarks.harness.server_process import free_port
    from shared.paths import REPO_ROOT as ROOT

    port = free_port()
    config = yaml.safe_load((ROOT / "chapters" / "ch09_scale_out" / "deploy" / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"] = {"num_replicas": 1, "spare_replicas": 0, "replica_cpus": 0.5, "torch_threads": 1,
                                         "device": "cpu", "precision": "fp32", "attention": "gather", "probe_interval_s": 3600,
                                         "drain_timeout_s": DRAIN_TIMEOUT_S}
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    env = dict(os.environ)
    with open(tmp_path / "serve.log", "wb") as log:  # a file, not a pipe nobody reads: a full pipe would block serve run
        serve = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", str(tmp_path / "serve_config.yaml")], cwd=ROOT,
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    prompts = [list(range(10 + i, 26 + i)) for i in range(16)]  # as many as the issue found cut
    try:
        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=DRAIN_TIMEOUT_S + 120) as client:
                deadline = time.monotonic() + 300
                while True:  # serve run has no readiness signal of its own but the route answering
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline and serve.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
                    await asyncio.sleep(1)
                first_tokens = [asyncio.Event() for _ in prompts[1::2]]
                wholes = [asyncio.create_task(_whole(client, p, LONG_TOKENS)) for p in prompts[0::2]]
                streams = [asyncio.create_task(_stream(client, p, e, LONG_TOKENS)) for p, e in zip(prompts[1::2], first_tokens, strict=True)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first_tokens)), 120)
                drain = await asyncio.create_subprocess_exec(sys.executable, "-m", "chapters.ch09_scale_out.stopping", "--timeout-s",
                                                             str(DRAIN_TIMEOUT_S), cwd=ROOT, env=env)
                answers = await asyncio.gather(*wholes, *streams)
                assert await asyncio.wait_for(drain.wait(), DRAIN_TIMEOUT_S + 60) == 0
                serve.send_signal(signal.SIGTERM)
                return answers

        answers = asyncio.run(run())
        serve.wait(timeout=120)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    for prompt, answer in zip([*prompts[0::2], *prompts[1::2]], answers, strict=True):
        assert answer == oracle(prompt, LONG_TOKENS)
