"""Chapter 9 as a learner runs it: ``python -m chapters.ch09_scale_out`` (a local Ray cluster, Serve's
proxy with the edge, two replicas of chapter 8's server behind the least-tokens router) on loopback,
started once for the module and stopped with SIGTERM by the fixture; Ray's start-up is paid once, in
``make test-slow``. The rest (Serve's options, the health rule, the drain before shutdown, the edge
and the router against stand-ins for Serve's proxy and router, the config file) runs on every run;
the deploy files as written are tests/test_ch09_deploy.py's.

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

from benchmarks.harness.server_process import running_module
from chapters.ch08_continuous_batching.server import ContinuousSettings
from chapters.ch09_scale_out.replica import ReplicaOptions, deployment_options, replica_health
from chapters.ch09_scale_out.server import ScaleOutSettings, replica_settings

MODULE = "chapters.ch09_scale_out"
# Ray's start and Serve's stop take about half a minute: the process tests run in `make test-slow`.
SLOW_RAY = pytest.mark.slow
ARGS = ["--num-replicas", "2", "--spare-replicas", "0", "--replica-cpus", "0.5", "--router", "least-tokens", "--device", "cpu", "--precision", "fp32", "--attention", "gather",
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

    from benchmarks.studies.scale_out_timeline.scale_out_timeline import outcome_of_stream, outcome_of_whole

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


@SLOW_RAY
def test_two_replicas_started_together_measure_once_and_answer_alike(tmp_path) -> None:
    """Both replicas leave the engine and attention to their rules, with nothing cached (a new node), started together on
    shared cores: one measures, the other serves its choice, and 50 greedy requests get one answer per prompt."""
    import asyncio

    args = ["--num-replicas", "2", "--spare-replicas", "0", "--replica-cpus", "0.5", "--device", "cpu", "--torch-threads", "1",
            "--max-num-seqs", "16", "--probe-interval-s", "3600", "--drain-timeout-s", "10"]
    prompts = [list(range(3 + i, 19 + i)) for i in range(5)]
    with running_module(MODULE, args, name="ch09-choice", env={"SFS_CACHE_DIR": str(tmp_path)}, startup_timeout_s=540) as server:
        async def ask_all() -> list[tuple[int, list[int]]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                async def ask(i: int) -> tuple[int, list[int]]:
                    response = await client.post("/v1/inference", json={"input_ids": prompts[i % 5], "max_new_tokens": 24})
                    assert response.status_code == 200, response.text
                    return i % 5, response.json()["output_ids"]
                return await asyncio.gather(*(ask(i) for i in range(50)))

        answers: dict[int, set[tuple[int, ...]]] = {}
        for prompt, tokens in asyncio.run(ask_all()):
            answers.setdefault(prompt, set()).add(tuple(tokens))
        log = server.log_tail(400_000)
    assert all(len(distinct) == 1 for distinct in answers.values()), answers
    assert log.count("measured here, recorded for the deployment") == 1, "not one replica measured"
    assert "engine and attention: the deployment's choice" in log, "the second replica did not serve the first one's choice"


def test_serves_limits_come_from_chapter_8s_scheduler_and_chapter_7s_drain() -> None:
    settings = ScaleOutSettings(max_num_seqs=16, max_queue=8, drain_timeout_s=12.0, num_replicas=3, spare_replicas=0, replica_cpus=0.5)
    options = deployment_options(replica_settings(settings), settings)
    assert options["max_ongoing_requests"] == 16 + 8  # never Serve's default of 5: that would cap a batch at 5 rows
    assert options["max_queued_requests"] == 8
    assert options["graceful_shutdown_timeout_s"] == 12.0
    assert options["num_replicas"] == 3 and options["ray_actor_options"] == {"num_cpus": 0.5}
    assert options["health_check_period_s"] <= 2  # a dead replica is noticed within that, not Serve's default 10 s
    assert "autoscaling_config" not in options and options["request_router_config"] == {}  # fixed count, Serve's router
    assert "max_replicas_per_node" not in options  # a laptop is one node: no limit unless asked
    spread = deployment_options(replica_settings(settings), settings.model_copy(update={"max_replicas_per_node": 1}))
    assert spread["max_replicas_per_node"] == 1
    replica = replica_settings(settings)
    assert set(replica.model_dump()) == set(ContinuousSettings.model_fields)  # nothing of the cluster's
    assert (replica.max_num_seqs, replica.max_queue, replica.drain_timeout_s) == (16, 8, 12.0)
    # every knob of chapter 8, plus the replicas' own: composed from the same option groups
    assert set(ScaleOutSettings.model_fields) - set(ContinuousSettings.model_fields) == set(ReplicaOptions.model_fields)


def test_autoscaling_runs_between_num_and_max_replicas_on_a_full_batch_per_replica() -> None:
    from ray.serve.config import AutoscalingConfig

    settings = ScaleOutSettings(max_num_seqs=16, num_replicas=1, spare_replicas=0, max_replicas=3, upscale_delay_s=2, downscale_delay_s=5)
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


def test_spare_replicas_run_beyond_what_the_load_needs_fixed_or_autoscaled() -> None:
    from ray.serve.config import AutoscalingConfig

    fixed = ScaleOutSettings(num_replicas=2)  # one spare by default: a kill never takes the load's capacity
    assert deployment_options(replica_settings(fixed), fixed)["num_replicas"] == 3
    none = ScaleOutSettings(num_replicas=2, spare_replicas=0)
    assert deployment_options(replica_settings(none), none)["num_replicas"] == 2
    scaled = ScaleOutSettings(num_replicas=1, spare_replicas=1, max_replicas=3)
    scaling = AutoscalingConfig(**deployment_options(replica_settings(scaled), scaled)["autoscaling_config"])
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (2, 2, 3)  # never below need + spare
    unscaled_max = ScaleOutSettings(num_replicas=2, spare_replicas=2, max_replicas=3)
    assert deployment_options(replica_settings(unscaled_max), unscaled_max)["autoscaling_config"]["max_replicas"] == 4


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


def test_a_replica_whose_probe_is_only_slow_is_busy_not_replaced_until_the_grace_runs_out() -> None:
    """Serve kills an unhealthy replica: a slow probe on busy cores must not cost the capacity the load needs."""
    from chapters.ch09_scale_out.replica import SLOW_PROBE_GRACE_S

    for slow in ("the probe took longer than 2 s", "the previous probe is still running"):
        replica_health(_Backend(False, slow), unready_for_s=SLOW_PROBE_GRACE_S / 2)
        with pytest.raises(RuntimeError, match="for"):
            replica_health(_Backend(False, slow), unready_for_s=SLOW_PROBE_GRACE_S + 1)
    with pytest.raises(RuntimeError, match="the probe failed"):
        replica_health(_Backend(False, "the probe failed: RuntimeError: boom"), unready_for_s=0.0)


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


def test_a_misspelled_setting_in_a_config_files_args_is_refused_in_one_line() -> None:
    from chapters.ch09_scale_out.server import app_builder

    with pytest.raises(ValueError, match=r"^chapter 9's args: no setting named num_replica \("):
        app_builder({"num_replica": 5, "torch_threads": 1})


def test_joining_a_cluster_by_flag_alone_is_refused_with_what_to_do(monkeypatch, capsys) -> None:
    """Ray's network mode is fixed when it is first imported: the address must come from the environment."""
    from chapters.ch09_scale_out.server import main

    monkeypatch.delenv("SFS_RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["--ray-address", "auto"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "--ray-address" in err and "SFS_RAY_ADDRESS=auto" in err


def test_the_proxy_loads_the_edge_from_serves_hook() -> None:
    """The variable Serve's proxy reads names a function that returns the middleware; the package sets it before Ray starts."""
    import os

    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    from chapters.ch09_scale_out.edge import ContractAtTheEdge
    from chapters.ch09_scale_out.stopping import DrainAtTheEdge

    path = os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]  # set by importing chapters.ch09_scale_out
    middlewares = validate_http_proxy_callback_return(call_function_from_import_path(path))
    assert [m.cls for m in middlewares] == [ContractAtTheEdge, DrainAtTheEdge]  # Serve wraps in order: the drain outermost


# ---------------------------------------------------------------- routing (routing.py)


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


def test_the_router_setting_becomes_serves_request_router_config() -> None:
    from ray.serve.config import RequestRouterConfig

    from chapters.ch09_scale_out.routing import LeastOutstandingTokensRouter, request_router_config
    from chapters.ch09_scale_out.server import build_application

    config = RequestRouterConfig(**request_router_config("least-tokens"))
    assert config.get_request_router_class() is LeastOutstandingTokensRouter
    assert build_application(ScaleOutSettings(router="least-tokens")) is not None
    with pytest.raises(ValueError, match="unknown router"):
        request_router_config("round-robin")


def test_serves_completion_callback_gives_back_the_tokens_a_routed_request_owed() -> None:
    """The ledger is emptied by Serve's own hook, called as Serve's router calls it when an answer ends.

    The router is built with Serve's constructor; ``AsyncioRouter._process_finished_request`` is the
    callback Serve registers on every request it sends, run here against a stand-in for the rest of
    Serve's router (no Ray cluster). Without ``on_request_completed`` a replica would owe a finished
    request's tokens forever and the router would stop sending it anything.
    """
    import asyncio
    import pickle
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata, StreamingHTTPRequest
    from ray.serve._private.router import AsyncioRouter
    from ray.serve.request_router import PendingRequest, ReplicaID

    from chapters.ch09_scale_out.routing import LeastOutstandingTokensRouter

    deployment = DeploymentID(name="ch09", app_name="ch09")
    replica_a, replica_b = ReplicaID("a", deployment), ReplicaID("b", deployment)

    def routed_request(internal_id: str, budget: int) -> PendingRequest:
        scope = {"type": "http", "headers": [(b"x-token-budget", str(budget).encode())]}
        request = pickle.dumps(StreamingHTTPRequest(asgi_scope=scope, proxy_actor_name="proxy"))  # as the proxy sends it
        # Serve's proxy gives each request two ids: the client's X-Request-ID (or one it made) and its own internal
        # one, which on_request_completed is called with; they never agree, so the ledger must key on the internal one.
        metadata = RequestMetadata(request_id=f"client-{internal_id}", internal_request_id=internal_id)
        return PendingRequest(args=[request], kwargs={}, metadata=metadata)

    async def run() -> None:
        router = LeastOutstandingTokensRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.PROXY)
        router.initialize_state()
        serves_router = SimpleNamespace(request_router=router, _active_request_router=router,
                                        _get_actor_died_error=lambda result: None,
                                        _metrics_manager=SimpleNamespace(dec_num_running_requests_for_replica=lambda replica_id: None))
        router.on_request_routed(routed_request("long", 512), replica_a, None)
        router.on_request_routed(routed_request("short", 16), replica_b, None)
        assert router.ledger.rank([replica_a, replica_b]) == [replica_b, replica_a]
        AsyncioRouter._process_finished_request(serves_router, replica_a, "long", None, "the answer")  # "long" ended
        assert router.ledger.owed == {replica_a: 0, replica_b: 16} and "long" not in router.ledger.requests
        assert router.ledger.rank([replica_b, replica_a]) == [replica_a, replica_b]

    asyncio.run(run())


# ---------------------------------------------------------------- the edge (edge.py) on paths the exercises do not cover


def _through_the_edge(proxy, client: list[dict], scope_headers: list | None = None) -> list[dict]:
    """What a client receives from the edge around ``proxy`` (Serve's proxy stood in for by an ASGI app).

    ``client`` is what the client sends, in order; after it, ``receive`` answers ``http.disconnect``
    if the client's last message was one (as an ASGI server does once a client has gone), else waits.
    """
    import asyncio

    from ray.serve._private.http_util import _apply_middlewares

    from chapters.ch09_scale_out.edge import proxy_middlewares

    sent: list[dict] = []
    incoming = list(client)
    gone = bool(client) and client[-1]["type"] == "http.disconnect"
    stays = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        if gone:
            return {"type": "http.disconnect"}
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    app = _apply_middlewares(proxy, proxy_middlewares())  # as Serve's proxy composes them: its RequestIdMiddleware, then ours
    scope = {"type": "http", "method": "POST", "path": "/v1/inference", "headers": list(scope_headers or [])}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
    return sent


def test_a_client_that_leaves_after_its_body_was_read_is_not_replayed_on_another_replica() -> None:
    """The edge replays only a request still replayable: its client still there, not merely its body whole.

    Serve's proxy, having read the body, listens for the client's disconnect while the replica works;
    when the client goes it cancels the request, which ends without a byte, just as when a replica dies.
    Replaying it would run the whole request again on a second replica for nobody.
    """
    calls: list[dict] = []

    async def proxy(scope, receive, send) -> None:
        calls.append(await receive())  # the body
        assert (await receive())["type"] == "http.disconnect"  # the client left; Serve cancels, nothing is sent

    body = {"type": "http.request", "body": b'{"input_ids": [1, 2], "max_new_tokens": 64}', "more_body": False}
    sent = _through_the_edge(proxy, [body, {"type": "http.disconnect"}])
    assert len(calls) == 1, "the request of a client that had left was sent to a second replica"
    assert sent == []  # nobody to answer


def test_an_answer_through_the_proxy_carries_one_request_id() -> None:
    """Serve's RequestIdMiddleware adds an ``X-Request-ID`` to the app's own; the client gets the app's, once."""
    from shared.schemas import REQUEST_ID_HEADER, request_id_from

    async def chapter_7_app(scope, receive, send) -> None:  # echoes the request id as chapter 7's shell does
        await receive()
        headers = {bytes(k).lower(): bytes(v).decode() for k, v in scope["headers"]}
        request_id = request_id_from(headers.get(REQUEST_ID_HEADER.lower().encode()))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (REQUEST_ID_HEADER.encode(), request_id.encode())]})
        await send({"type": "http.response.body", "body": json.dumps({"request_id": request_id}).encode()})

    body = {"type": "http.request", "body": b"{}", "more_body": False}
    for client_id in (None, b"trace-42", b"not a sane id!"):
        sent = _through_the_edge(chapter_7_app, [body], [(b"x-request-id", client_id)] if client_id else [])
        ids = [bytes(v).decode() for k, v in sent[0]["headers"] if bytes(k).lower() == b"x-request-id"]
        assert len(ids) == 1, (client_id, sent[0]["headers"])
        assert ids[0] == json.loads(sent[1]["body"])["request_id"]  # the id the answer's body and logs name
        if client_id == b"trace-42":
            assert ids == ["trace-42"]


def test_the_drill_counts_capacity_back_when_the_survivors_carry_the_load_and_the_replacement_apart() -> None:
    from benchmarks.studies.scale_out_timeline.scale_out_timeline import Poll, RequestSpan, account

    polls = [Poll(-0.25, 3, [1, 2, 3]), Poll(0.25, 3, [2, 3]), Poll(0.5, 2, [2, 3]), Poll(6.0, 2, [2, 3, 4]), Poll(8.0, 3, [2, 3, 4])]
    requests = [RequestSpan(-2.0, -1.0, False, 200, "ok"), RequestSpan(-0.5, 0.5, True, 200, "replayed"),
                RequestSpan(0.6, 1.0, False, 200, "ok")]
    with_spare = account(requests, polls, num_replicas=2, spare_replicas=1)
    assert (with_spare["capacity_back_s"], with_spare["replacement_ready_s"]) == (0.25, 8.0)  # two survivors carry the need of two
    without = account(requests, polls, num_replicas=3)
    assert without["capacity_back_s"] == without["replacement_ready_s"] == 8.0  # the need of three is back with the replacement
    assert (with_spare["answers_per_s_before"], with_spare["answers_per_s_after"]) == (0.2, 0.4)
