"""Chapter 9 as a learner runs it: ``python -m chapters.ch09_scale_out`` (a local Ray cluster, Serve's
proxy with the edge, two replicas of chapter 8's server behind the least-tokens router) on loopback,
started once for the module and stopped with SIGTERM by the fixture; Ray's start-up is paid once, in
``make test-slow``. The rest (Serve's options, the health rule, the drain before shutdown, the edge
and the router against stand-ins for Serve's proxy, the config file and the manifest) runs on every run.

Through the proxy every replica answers exactly as chapter 8 does: the oracle's tokens, whole or
streamed, and the OpenAI routes to the official client. A replica killed mid-request costs only its
own requests, each replayed or answered with the contract's error. Nothing the process tree opened
listens beyond 127.0.0.1, and once it stops no process of it is left.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.server_process import running_module
from chapters.ch08_continuous_batching.server import ContinuousSettings
from chapters.ch09_scale_out.replica import ReplicaOptions, deployment_options, replica_health
from chapters.ch09_scale_out.server import ScaleOutSettings, replica_settings

MODULE = "chapters.ch09_scale_out"
# Ray's start and Serve's stop take about half a minute: the process tests run in `make test-slow`.
SLOW_RAY = pytest.mark.slow
ARGS = ["--num-replicas", "2", "--replica-cpus", "0.5", "--router", "least-tokens", "--device", "cpu", "--precision", "fp32", "--attention", "gather",
        "--torch-threads", "1", "--max-num-seqs", "16", "--max-queue", "8", "--probe-interval-s", "3600",
        "--drain-timeout-s", "10"]
PROMPTS = [[5, 6, 7, 8], [1, 2, 3], list(range(20, 52))]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def cluster():
    """The chapter's server as a process; yields (url, pids of its process tree); checks it stopped and left nothing."""
    with running_module(MODULE, ARGS, name="ch09", startup_timeout_s=240) as server:
        pids = {p.pid for p in _tree(server.process.pid)}
        yield server.url, server.process.pid
        pids |= {p.pid for p in _tree(server.process.pid)}
    assert server.process.returncode in (0, -signal.SIGTERM), server.log_tail(2000)
    left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes of the cluster still running after it stopped: {left}"


@SLOW_RAY
def test_a_replica_answers_the_oracles_tokens_through_the_proxy(cluster, oracle) -> None:
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=60) as client:
        for prompt in PROMPTS:
            response = client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": 12})
            assert response.status_code == 200, response.text
            assert response.json()["output_ids"] == oracle(prompt, 12)


@SLOW_RAY
def test_a_stream_through_the_proxy_carries_the_oracles_tokens_one_event_each(cluster, oracle) -> None:
    url, _ = cluster
    body = {"input_ids": PROMPTS[0], "max_new_tokens": 10, "stream": True}
    tokens, done = [], None
    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/v1/inference", json=body) as response:
        assert response.status_code == 200
        event = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "token":
                tokens.append(json.loads(line.removeprefix("data: "))["token_id"])
            elif line.startswith("data: ") and event == "done":
                done = json.loads(line.removeprefix("data: "))
    assert tokens == oracle(PROMPTS[0], 10) and done["output_ids"] == tokens


@SLOW_RAY
def test_the_official_openai_client_completes_through_the_proxy(cluster, oracle) -> None:
    from openai import OpenAI

    url, _ = cluster
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8


@SLOW_RAY
def test_bad_input_gets_the_contracts_json_error_through_the_proxy(cluster) -> None:
    url, _ = cluster
    response = httpx.post(f"{url}/v1/inference", json={"input_ids": [], "max_new_tokens": 4}, timeout=30)
    assert response.status_code == 422
    assert response.json()["error"]["type"]


@SLOW_RAY
def test_nothing_of_the_cluster_listens_beyond_loopback(cluster) -> None:
    _, pid = cluster
    pids = {p.pid for p in _tree(pid)}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert listening, "found no listening socket of the cluster's processes: the check would prove nothing"
    exposed = sorted({(c.laddr.ip, c.laddr.port) for c in listening if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")})
    assert not exposed, f"listening beyond loopback: {exposed}"


@SLOW_RAY
def test_a_replica_killed_mid_request_costs_only_its_requests_each_replayed_or_answered_by_the_contract(cluster, oracle) -> None:
    """Last of the cluster's tests: it leaves Serve replacing the replica it killed."""
    import asyncio

    from benchmarks.scale_out_timeline import outcome_of_stream, outcome_of_whole

    url, pid = cluster
    replicas = [p for p in _tree(pid) if any("ServeReplica:" in part for part in p.cmdline())]
    assert len(replicas) == 2, [p.cmdline() for p in _tree(pid)]
    prompts = [list(range(10 + i, 26 + i)) for i in range(8)]
    new_tokens = 96  # long enough to be mid-answer when the kill lands

    async def run() -> list[tuple[bool, str, str, list[int] | None]]:
        streams_started = [asyncio.Event() for _ in prompts[::2]]

        async def ask(client: httpx.AsyncClient, index: int):
            body = {"input_ids": prompts[index], "max_new_tokens": new_tokens, "stream": index % 2 == 0}
            if index % 2:
                response = await client.post("/v1/inference", json=body)
                outcome, detail = outcome_of_whole(response.status_code, response.headers, response.content)
                tokens = response.json().get("output_ids") if response.status_code == 200 else None
                return False, outcome, detail, tokens
            lines = []
            async with client.stream("POST", "/v1/inference", json=body) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line == "event: token":
                        streams_started[index // 2].set()
            streams_started[index // 2].set()
            return True, *outcome_of_stream(response.status_code, response.headers, [x for x in lines if x]), None

        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            asks = [asyncio.create_task(ask(client, i)) for i in range(len(prompts))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streams_started)), 60)  # every stream is mid-answer
            replicas[0].kill()
            return await asyncio.gather(*asks)

    results = asyncio.run(run())
    outcomes = [outcome for _, outcome, _, _ in results]
    assert "broken" not in outcomes, results  # no plain text, no stream cut without its error event
    assert sum(o != "ok" for o in outcomes) >= 1, "the killed replica held none of the requests: the test proved nothing"
    for (stream, outcome, detail, tokens), prompt in zip(results, prompts, strict=True):
        if outcome == "contract_error":
            assert detail == "replica_failed"
        if not stream and tokens is not None:
            assert tokens == oracle(prompt, new_tokens)  # a replayed answer is the answer


def test_serves_limits_come_from_chapter_8s_scheduler_and_chapter_7s_drain() -> None:
    settings = ScaleOutSettings(max_num_seqs=16, max_queue=8, drain_timeout_s=12.0, num_replicas=3, replica_cpus=0.5)
    options = deployment_options(replica_settings(settings), settings)
    assert options["max_ongoing_requests"] == 16 + 8  # never Serve's default of 5: that would cap a batch at 5 rows
    assert options["max_queued_requests"] == 8
    assert options["graceful_shutdown_timeout_s"] == 12.0
    assert options["num_replicas"] == 3 and options["ray_actor_options"] == {"num_cpus": 0.5}
    assert options["health_check_period_s"] <= 2  # a dead replica is noticed within that, not Serve's default 10 s
    assert "autoscaling_config" not in options and options["request_router_config"] == {}  # fixed count, Serve's router
    replica = replica_settings(settings)
    assert set(replica.model_dump()) == set(ContinuousSettings.model_fields)  # nothing of the cluster's
    assert (replica.max_num_seqs, replica.max_queue, replica.drain_timeout_s) == (16, 8, 12.0)
    # every knob of chapter 8, plus the replicas' own: composed from the same option groups
    assert set(ScaleOutSettings.model_fields) - set(ContinuousSettings.model_fields) == set(ReplicaOptions.model_fields)


def test_autoscaling_runs_between_num_and_max_replicas_on_a_full_batch_per_replica() -> None:
    from ray.serve.config import AutoscalingConfig

    settings = ScaleOutSettings(max_num_seqs=16, num_replicas=1, max_replicas=3, upscale_delay_s=2, downscale_delay_s=5)
    options = deployment_options(replica_settings(settings), settings)
    scaling = AutoscalingConfig(**options["autoscaling_config"])  # Serve's own validation
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 1, 3)
    assert scaling.target_ongoing_requests == 16  # a replica whose batch is full is busy
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (2, 5)
    assert scaling.metrics_interval_s <= scaling.look_back_period_s  # every window holds samples
    assert "num_replicas" not in options  # Serve refuses both
    assert options["max_ongoing_requests"] > scaling.target_ongoing_requests  # room to queue above the target
    with pytest.raises(ValueError, match="max-replicas"):
        ScaleOutSettings(num_replicas=3, max_replicas=2)


class _Backend:
    def __init__(self, ready: bool, reason: str, probed: bool = True, draining: bool = False) -> None:
        self._verdict = (ready, reason)
        self.probe = type("Probe", (), {"last": object() if probed else None})()
        self.drain = type("Drain", (), {"draining": draining})()

    def readiness(self):
        return self._verdict


def test_a_replica_is_unhealthy_only_when_chapter_7s_probe_failed() -> None:
    replica_health(_Backend(True, "ok"))
    replica_health(_Backend(False, "starting: no probe has run yet", probed=False))  # start-up
    replica_health(_Backend(False, "draining", draining=True))  # Serve is already stopping it
    with pytest.raises(RuntimeError, match="the probe failed"):
        replica_health(_Backend(False, "the probe failed: RuntimeError: boom"))


def test_the_app_drains_before_its_own_shutdown_when_serve_stops_the_replica() -> None:
    import asyncio

    from chapters.ch07_production.drain import DrainController
    from chapters.ch09_scale_out.replica import DrainBeforeShutdown

    seen: list[str] = []
    drain = DrainController(timeout_s=5)

    async def app(scope, receive, send) -> None:  # an ASGI app that records what its lifespan sees
        while True:
            message = await receive()
            seen.append(f"{message['type']} (draining={drain.draining}, in flight={drain.in_flight})")
            if message["type"] == "lifespan.shutdown":
                return

    async def run() -> None:
        messages = asyncio.Queue()
        for message in ({"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}):
            messages.put_nowait(message)
        await asyncio.wait_for(DrainBeforeShutdown(app, drain)({"type": "lifespan"}, messages.get, None), 5)

    asyncio.run(run())
    # the drain ran (readiness off, new work refused) before the app's own shutdown began
    assert seen == ["lifespan.startup (draining=False, in flight=0)", "lifespan.shutdown (draining=True, in flight=0)"]


DEPLOY = Path(__file__).resolve().parents[1] / "chapters" / "ch09_scale_out" / "deploy"


def test_the_serve_config_file_is_valid_for_serve_and_names_only_chapter_9s_settings() -> None:
    import yaml
    from ray._common.utils import import_attr
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1"  # loopback unless you mean to expose it
    for application in config.applications:
        builder = import_attr(application.import_path)
        assert set(application.args) <= set(ScaleOutSettings.model_fields), "a misspelt setting would be ignored"
        assert isinstance(builder(application.args), Application)
        assert not application.deployments, "the replicas' Serve options come from the settings, not from the file"


def test_the_rayservice_manifest_deploys_the_same_application_with_chapter_7s_probes() -> None:
    import ray
    import yaml
    from ray.serve.schema import ServeDeploySchema

    manifest = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    local = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    served = ServeDeploySchema.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    assert [a.model_dump() for a in served.applications] == [
        a.model_dump() for a in ServeDeploySchema.model_validate(local).applications]
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray is the one the code was checked with
    port = served.http_options.port
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
        assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
        drain_s = max(float(a.args.get("drain_timeout_s", 30)) for a in served.applications)
        assert pod["terminationGracePeriodSeconds"] > drain_s  # the pod outlives its replicas' drain


def test_joining_a_cluster_by_flag_alone_is_refused_with_what_to_do(monkeypatch, capsys) -> None:
    """Ray's network mode is fixed when it is first imported: the address must come from the environment."""
    from chapters.ch09_scale_out.server import main

    monkeypatch.delenv("SFS_RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["--ray-address", "auto"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "--ray-address" in err and "SFS_RAY_ADDRESS=auto" in err


# ---------------------------------------------------------------- the contract at the edge (edge.py)
# The proxy is stood in for by ASGI apps that do what Serve 2.60's proxy does: answer from a replica,
# send its own plain-text refusal, or end a request whose replica died without sending anything
# (uvicorn would then answer a plain-text 500) or in the middle of a stream.


def _call_edge(proxy, path: str = "/v1/inference", body: bytes = b'{"input_ids": [1], "max_new_tokens": 2}',
               disconnect_first: bool = False) -> list[dict]:
    import asyncio

    from chapters.ch09_scale_out.edge import ContractAtTheEdge

    sent: list[dict] = []
    incoming = [{"type": "http.disconnect"}] if disconnect_first else [{"type": "http.request", "body": body, "more_body": False}]
    client_gone = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await client_gone.wait()  # the client stays until the test ends
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(asyncio.wait_for(ContractAtTheEdge(proxy)(scope, receive, send), 5))
    return sent


def _response(sent: list[dict]) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, ended properly) of what the client received."""
    assert sent and sent[0]["type"] == "http.response.start", sent
    headers = {bytes(k).lower(): bytes(v) for k, v in sent[0].get("headers", [])}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], headers, body, not sent[-1].get("more_body", False)


def _replica_died_first_then(answer: list[dict], bodies: list[bytes]):
    """A proxy whose first attempt ends without a byte (the replica died), then answers ``answer``."""
    attempts = []

    async def proxy(scope, receive, send) -> None:
        bodies.append((await receive())["body"])
        attempts.append(scope["path"])
        if len(attempts) == 1:
            return
        for message in answer:
            await send(message)

    return proxy


OK_ANSWER = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
             {"type": "http.response.body", "body": b'{"output_ids": [3, 4]}', "more_body": False}]


def test_a_request_whose_replica_died_before_answering_is_sent_again_with_its_body() -> None:
    bodies: list[bytes] = []
    body = b'{"input_ids": [5, 6], "max_new_tokens": 3}'
    status, headers, answer, ended = _response(_call_edge(_replica_died_first_then(OK_ANSWER, bodies), body=body))
    assert (status, answer, ended) == (200, b'{"output_ids": [3, 4]}', True)
    assert headers[b"x-attempts"] == b"2"  # a replay is visible to whoever counts them
    assert bodies == [body, body]  # the second replica read the same request


def test_a_request_whose_replicas_die_twice_gets_the_contracts_json_500() -> None:
    async def dead(scope, receive, send) -> None:
        await receive()

    status, headers, body, ended = _response(_call_edge(dead))
    assert status == 500 and headers[b"content-type"] == b"application/json" and ended
    assert json.loads(body)["error"]["type"] == "replica_failed"


def test_a_client_that_has_gone_is_neither_replayed_nor_answered() -> None:
    calls = []

    async def proxy(scope, receive, send) -> None:
        calls.append(await receive())

    assert _call_edge(proxy, disconnect_first=True) == [] and len(calls) == 1


def test_a_body_too_large_to_keep_is_not_replayed() -> None:
    from chapters.ch09_scale_out.edge import REPLAY_LIMIT_BYTES

    bodies: list[bytes] = []
    status, _, body, _ = _response(_call_edge(_replica_died_first_then(OK_ANSWER, bodies), body=b"x" * (REPLAY_LIMIT_BYTES + 1)))
    assert status == 500 and json.loads(body)["error"]["type"] == "replica_failed" and len(bodies) == 1


@pytest.mark.parametrize(("path", "dialect"), [("/v1/inference", "event: error\ndata: "), ("/v1/completions", "data: ")])
def test_a_stream_cut_by_a_dying_replica_ends_with_the_contracts_error_event(path: str, dialect: str) -> None:
    first = b"event: token\ndata: {\"token_id\": 7}\n\n"

    async def cut(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": first, "more_body": True})  # then the replica dies

    status, _, body, ended = _response(_call_edge(cut, path=path))
    assert status == 200 and ended and body.startswith(first)
    last = body[len(first):].decode()
    assert last.startswith(dialect) and last.endswith("\n\n")
    assert json.loads(last.removeprefix(dialect))["error"]["type"] == "replica_failed"


@pytest.mark.parametrize(("status", "error_type"), [(503, "unavailable"), (408, "deadline_exceeded"), (404, "not_found")])
def test_serves_own_plain_text_refusals_become_the_contracts_json(status: int, error_type: str) -> None:
    async def refuses(scope, receive, send) -> None:  # what Serve's proxy sends (convert_object_to_asgi_messages)
        await receive()
        await send({"type": "http.response.start", "status": status,
                    "headers": [[b"content-type", b"text/plain; charset=utf-8"], [b"x-request-id", b"abc"]]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure", "more_body": False})

    got, headers, body, ended = _response(_call_edge(refuses))
    assert got == status and ended and headers[b"content-type"] == b"application/json"
    assert json.loads(body) == {"error": {"type": error_type, "message": "Request dropped due to backpressure"}}
    assert headers[b"x-request-id"] == b"abc" and int(headers[b"content-length"]) == len(body)
    assert (b"retry-after" in headers) == (status == 503)


def test_the_apps_own_answers_pass_the_edge_unchanged() -> None:
    error = [{"type": "http.response.start", "status": 422, "headers": [(b"content-type", b"application/json")]},
             {"type": "http.response.body", "body": b'{"error": {"type": "invalid_request", "message": "m"}}', "more_body": False}]
    for answer in (OK_ANSWER, error):
        async def proxy(scope, receive, send, answer=answer) -> None:
            await receive()
            for message in answer:
                await send(message)

        assert _call_edge(proxy) == answer


def test_the_proxy_loads_the_edge_from_serves_hook() -> None:
    """The variable Serve's proxy reads names a function that returns the middleware; the package sets it before Ray starts."""
    import os

    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    from chapters.ch09_scale_out.edge import ContractAtTheEdge

    path = os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]  # set by importing chapters.ch09_scale_out
    middlewares = validate_http_proxy_callback_return(call_function_from_import_path(path))
    assert [m.cls for m in middlewares] == [ContractAtTheEdge]


# ---------------------------------------------------------------- routing (routing.py)


@pytest.mark.parametrize(("body", "budget"), [
    ({"input_ids": [1, 2, 3], "max_new_tokens": 10}, 13),
    ({"prompt": "héllo", "max_new_tokens": 4}, 6 + 4),  # a text prompt counts its UTF-8 bytes
    ({"model": "m", "prompt": [5, 6], "max_tokens": 7}, 9),
    ({"model": "m", "messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": "de"}], "max_tokens": 1}, 6),
    ({"input_ids": [1], "max_new_tokens": "many"}, None),
    ({"max_new_tokens": 3}, None),
    ([1, 2], None),
])
def test_a_requests_token_budget_is_its_prompt_plus_what_it_may_generate(body, budget) -> None:
    from chapters.ch09_scale_out.routing import token_budget

    assert token_budget(json.dumps(body).encode()) == budget
    assert token_budget(b"not json") is None


def test_the_edge_writes_the_budget_for_the_router_and_drops_a_clients_own() -> None:
    from chapters.ch09_scale_out.edge import with_token_budget

    scope = {"type": "http", "headers": [(b"x-token-budget", b"1"), (b"host", b"h")]}
    routed = with_token_budget(scope, b'{"input_ids": [1, 2], "max_new_tokens": 30}')
    assert routed["headers"] == [(b"host", b"h"), (b"x-token-budget", b"32")]
    assert with_token_budget(scope, None)["headers"] == [(b"host", b"h")]  # a body too large to read: no budget
    assert scope["headers"][0] == (b"x-token-budget", b"1")  # the proxy's own scope is not changed under it


def test_the_router_reads_the_budget_from_the_request_the_proxy_routes() -> None:
    import pickle

    from ray.serve._private.common import StreamingHTTPRequest

    from chapters.ch09_scale_out.routing import budget_of

    class Pending:
        def __init__(self, args) -> None:
            self.args = args

    scope = {"type": "http", "headers": [(b"x-token-budget", b"272")]}
    assert budget_of(Pending([pickle.dumps(StreamingHTTPRequest(asgi_scope=scope, proxy_actor_name="p"))])) == 272
    assert budget_of(Pending([StreamingHTTPRequest(asgi_scope={"headers": []}, proxy_actor_name="p")])) == 0
    assert budget_of(Pending([{"a handle call": 1}])) == 0 and budget_of(None) == 0


def test_the_ledger_ranks_replicas_by_tokens_owed_until_their_requests_complete() -> None:
    from chapters.ch09_scale_out.routing import TokenLedger

    ledger = TokenLedger()
    ledger.routed("long", "A", 512 + 64)
    ledger.routed("short-1", "B", 16 + 64)
    ledger.routed("short-2", "B", 16 + 64)
    assert ledger.rank(["A", "B", "C"]) == ["C", "B", "A"]  # three requests in flight, but A owes the most tokens
    ledger.completed("long")
    ledger.completed("unknown")  # a request routed before this ledger existed: nothing to take back
    assert ledger.rank(["A", "B"]) == ["A", "B"] and ledger.owed == {"A": 0, "B": 160}
    ledger.forget("B")
    assert ledger.owed == {"A": 0} and ledger.requests == {}


def test_least_tokens_offers_the_replica_owing_the_fewest_tokens_first() -> None:
    import asyncio

    from chapters.ch09_scale_out.routing import LeastOutstandingTokensRouter, TokenLedger

    class Replica:
        def __init__(self, replica_id: str) -> None:
            self.replica_id = replica_id

    router = LeastOutstandingTokensRouter.__new__(LeastOutstandingTokensRouter)  # the policy, without Serve's plumbing
    router.ledger = TokenLedger()
    replicas = [Replica("A"), Replica("B"), Replica("C")]
    router.ledger.routed("r1", "A", 300)
    router.ledger.routed("r2", "C", 20)
    ranks = asyncio.run(router.choose_replicas(replicas))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["B"], ["C"], ["A"]]


def test_the_router_setting_becomes_serves_request_router_config() -> None:
    from ray.serve.config import RequestRouterConfig

    from chapters.ch09_scale_out.routing import LeastOutstandingTokensRouter, request_router_config
    from chapters.ch09_scale_out.server import build_application

    config = RequestRouterConfig(**request_router_config("least-tokens"))
    assert config.get_request_router_class() is LeastOutstandingTokensRouter
    assert build_application(ScaleOutSettings(router="least-tokens")) is not None
    with pytest.raises(ValueError, match="unknown router"):
        request_router_config("round-robin")
