"""Chapter 7: production. Chapter 6's server, wrapped in what keeps it alive and visible.

Each model version is a backend (chapter 6's ``build_backend``, or any ``backend_factory``) known only through chapter 2's
:class:`~chapters.ch02_fastapi_async.api.Backend`. :class:`ProductionBackend` and the routes add around it: ``/livez``,
``/readyz`` (:mod:`health`), the SIGTERM drain (:mod:`drain`), deadlines and disconnects (:mod:`deadlines`), ``/metrics``
and a JSON log line per request, hot reload through ``POST /admin/models``, and ``--leak-lesson``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings

from chapters.ch02_fastapi_async.api import (
    INFERENCE_CONTRACT,
    Backend,
    DisconnectCheck,
    Generated,
    RequestContract,
    StreamWriter,
    create_app,
)
from chapters.ch03_dynamic_batching.live_view import PAGE_DIR, LiveEvents, LiveView
from chapters.ch04_memory_pool.server import AdmissionOptions, PoolOptions
from chapters.ch05_inference_engine.server import EngineOptions
from chapters.ch06_tuned_batching.server import TunedBatcherOptions, apply_tuned_config, build_backend
from chapters.ch07_production.deadlines import (
    TIMEOUT_HEADER,
    ClientChannel,
    StreamDeadline,
    client_receive,
    effective_timeout,
    until_disconnected,
    within_deadline,
)
from chapters.ch07_production.drain import DrainController, DrainingServer
from chapters.ch07_production.health import ReadinessProbe, request_probe
from chapters.ch07_production.metrics import StateCollector, StateReader, build_registry, pooled_state
from chapters.ch07_production.model_registry import MODEL_VERSION_HEADER, ModelRegistry, ModelVersion
from chapters.ch07_production.request_log import RequestContext, RequestObserver, configure_json_logging, current_request
from chapters.ch07_production.startup_heap import freeze_startup_heap
from shared.devices import choose_device, memory_snapshot, set_threads
from shared.schemas import ApiError, ContractLimits, ValidRequest
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.unwritten import or_meanwhile
from shared.weights import LoadedModel, load_served_model

log = logging.getLogger("chapters.ch07_production")

# builds one version's backend from the server's settings and its loaded model
BackendFactory = Callable[[Any, LoadedModel], Backend]
# what the live page (chapter 3's /ui/) watches in a backend
EventsReader = Callable[[Any], LiveEvents]


def batcher_events(backend: Any) -> LiveEvents:
    """Chapter 6's backend: its batcher's events."""
    return backend.batcher.events


class ProductionOptions(BaseSettings):
    """The production shell's knobs: drain, deadlines, readiness, hot reload, the leak lesson (any backend)."""

    model_config = ServerSettings.model_config

    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, wait this long for accepted requests before exiting")
    request_timeout_s: float = Field(60.0, gt=0, description="deadline of every request (504 past it); X-Request-Timeout-S may shorten it")
    probe_interval_s: float = Field(5.0, gt=0, description="seconds between readiness probes (a real prefill + decode)")
    probe_timeout_s: float = Field(2.0, gt=0, description="a probe slower than this makes the server not ready")
    admin_token: str = Field("", description="bearer token of POST /admin/models (empty: the admin API is off)")
    model_version: str = Field("v1", description="name of the version loaded at start-up")
    seed: int = Field(0, ge=0, description="seed of --weights dummy")
    max_unload_wait_s: float = Field(60.0, ge=0, description="a replaced version unloads when idle, or after this long anyway")
    keep_alive_s: float = Field(75.0, gt=0, description="idle keep-alive of client connections (longer than a load balancer's idle timeout)")
    memory_snapshots: bool = Field(
        False, description="log the memory in use at each stage of every request (RSS and tracemalloc; CUDA allocated/reserved)")
    leak_lesson: Literal["off", "leaky", "fixed"] = Field(
        "off", description="keep a per-request intermediate tensor: leaky = the article's bug (failed requests keep it), fixed = released in finally")


class ProductionSettings(ProductionOptions, TunedBatcherOptions, EngineOptions, PoolOptions, AdmissionOptions, ServerSettings):
    """Chapter 6's knobs plus the production shell's."""


class LoadRequest(BaseModel):
    """The body of ``POST /admin/models``."""

    version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._\-]+$")
    weights: str = Field("dummy", description="dummy | default | path to a .safetensors file")
    seed: int = Field(0, ge=0)
    retire_previous: bool = True


class ProductionBackend:
    """Chapter 2's Backend protocol over model versions, with drain, deadlines and readiness."""

    def __init__(self, settings: ProductionOptions, registry: ModelRegistry, first: ModelVersion,
                 drain: DrainController, probe: ReadinessProbe, chapter: str = "ch07") -> None:
        self.settings, self.registry, self.first, self.drain, self.probe = settings, registry, first, drain, probe
        self.chapter = chapter
        config, model = first.loaded.config, first.loaded.model
        self.staging: dict[int, torch.Tensor] = {}  # per request in flight (see _generate_on)
        self.staging_shape, self.staging_device = (config.n_ctx, config.n_embd), model.device

    async def start(self) -> None:
        await self.registry.add(self.first)
        self.first = None
        self.probe.start()

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): what ``/readyz`` answers."""
        if self.drain.draining:
            return False, "draining"
        if self.registry.newest() is None:
            return False, "loading"
        last = self.probe.last
        if last is None:
            return False, "starting: no probe has run yet"
        return last.ok, last.reason

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        context = current_request.get()
        headers = context.headers if context is not None else {}
        timeout_s = effective_timeout(self.settings.request_timeout_s, headers.get(TIMEOUT_HEADER.lower()))
        self.snapshot(context, "arrival")
        self.drain.enter()
        try:
            version = self.registry.route(headers.get(MODEL_VERSION_HEADER.lower()))
            if context is not None:
                context.model_version, context.input_tokens = version.name, len(request.input_ids)
            with version.use() as backend:
                self.snapshot(context, "routed")
                try:
                    result = await self._generate_on(backend, request, is_disconnected, timeout_s)
                finally:
                    self.snapshot(context, "generated")
        finally:
            self.drain.exit()
        if context is not None:
            context.output_tokens, context.timings_ms = len(result.output_ids), dict(result.timings_ms)
            context.backend_done = time.perf_counter()
        return result

    def snapshot(self, context: RequestContext | None, stage: str) -> None:
        """With ``--memory-snapshots``: the memory in use (RSS, the traced Python heap, CUDA's) as the request enters
        ``stage``, kept in ``context`` for its log line."""
        if not self.settings.memory_snapshots or context is None:
            return
        figures = memory_snapshot(self.staging_device)
        if tracemalloc.is_tracing():
            figures["python_traced_bytes"] = tracemalloc.get_traced_memory()[0]
        context.memory = {**(context.memory or {}), stage: figures}

    async def _generate_on(self, backend: Backend, request: ValidRequest, is_disconnected: DisconnectCheck,
                           timeout_s: float) -> Generated:
        # a per-request intermediate on the model's device, kept in a table while the request is in flight
        if self.settings.leak_lesson == "off":
            return await self._watched(backend, request, is_disconnected, timeout_s)
        key = id(request)
        self.staging[key] = torch.zeros(self.staging_shape, device=self.staging_device)
        if self.settings.leak_lesson == "leaky":
            # THE ARTICLE'S LEAK: released on the success path only; a failed request's buffer stays for good
            result = await self._watched(backend, request, is_disconnected, timeout_s)
            del self.staging[key]
            return result
        # EXERCISE ch07.4 BEGIN "the fix: release the request's intermediate on every path"
        try:
            return await self._watched(backend, request, is_disconnected, timeout_s)
        finally:
            del self.staging[key]

    async def _watched(self, backend: Backend, request: ValidRequest, is_disconnected: DisconnectCheck,
                       timeout_s: float) -> Generated:
        # the backend call, cancelled past its deadline (504) or when its client hangs up (499)
        work = backend.generate(request, is_disconnected)
        receive = client_receive.get()
        return await within_deadline(work if receive is None else until_disconnected(work, receive), timeout_s)

    async def open_stream(self, request: ValidRequest) -> AsyncIterator[int | Generated]:
        """Admit ``request`` on a streaming backend's version now (a refusal is still a JSON error); returns its tokens,
        then the :class:`Generated`, or 504 past the deadline. However the stream ends, even unread, the backend's stream
        is closed and the drain's and the version's counts are given back."""
        context = current_request.get()
        headers = context.headers if context is not None else {}
        timeout_s = effective_timeout(self.settings.request_timeout_s, headers.get(TIMEOUT_HEADER.lower()))
        with ExitStack() as held:
            self.drain.enter()
            held.callback(self.drain.exit)
            version = self.registry.route(headers.get(MODEL_VERSION_HEADER.lower()))
            backend = held.enter_context(version.use())
            if context is not None:
                context.model_version, context.input_tokens = version.name, len(request.input_ids)
            inner = await backend.open_stream(request)
            releases: list[Callable[[], object]] = []
            stream = self._streamed(inner, releases, asyncio.get_running_loop().time() + timeout_s, timeout_s, context)
            # a generator never started runs no finally: given back when the stream is dropped, too
            releases.append(weakref.finalize(stream, held.pop_all().close))
            return stream

    async def _streamed(self, inner: AsyncIterator, releases: list[Callable[[], object]], deadline: float, timeout_s: float,
                        context: RequestContext | None) -> AsyncIterator[int | Generated]:
        """``inner``'s events until ``deadline`` (the event loop's clock), then 504; the counts given back at the end."""
        within = StreamDeadline(deadline)
        try:
            try:
                while True:
                    try:
                        event = await within.next(inner)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        raise ApiError(504, "deadline_exceeded", f"the request did not finish within its deadline of {timeout_s:g} s") from None
                    if isinstance(event, Generated) and context is not None:
                        context.output_tokens, context.timings_ms = len(event.output_ids), dict(event.timings_ms)
                        context.backend_done = time.perf_counter()
                    yield event
            finally:
                within.cancel()
                await inner.aclose()
        finally:
            for release in releases:
                release()

    def health(self) -> dict:
        ready, reason = self.readiness()
        newest = self.registry.newest()
        return {"chapter": self.chapter, "model": newest.source if newest else None,
                "backend": newest.backend.health() if newest is not None and newest.backend is not None else None,
                "ready": ready, "reason": reason, "draining": self.drain.draining,
                "versions": {v.name: {"source": v.source, "in_flight": v.in_flight, "retired": v.retired}
                             for v in self.registry.versions.values()}}

    def stats(self) -> dict:
        newest = self.registry.newest()
        versions = {v.name: v.backend.stats() for v in self.registry.versions.values() if v.backend is not None}
        top = versions.get(newest.name, {}) if newest is not None else {}
        return {**top, **self.health(), "in_flight": self.drain.in_flight, "model_versions": versions,
                "unloaded": [vars(u) for u in self.registry.unloaded]}

    async def close(self) -> None:
        await self.probe.close()
        await self.registry.close()


def build_version(settings: ServerSettings, name: str, weights: str, seed: int, backend_factory: BackendFactory = build_backend) -> ModelVersion:
    """Load ``weights`` and build its backend with ``backend_factory`` (blocking: run it off the event loop)."""
    loaded = load_served_model(settings, weights, seed=seed)
    return ModelVersion(name, loaded, backend_factory(settings, loaded))


def build_app(settings: ProductionSettings, backend_factory: BackendFactory = build_backend,
              probe: Callable[[], Awaitable[None]] | None = None, read_state: StateReader = pooled_state,
              title: str = "ch07 production", chapter: str = "ch07", stream_writer: StreamWriter | None = None,
              contract: RequestContract = INFERENCE_CONTRACT, read_events: EventsReader = batcher_events,
              pages: tuple[Path, ...] = (PAGE_DIR,)) -> FastAPI:
    """The server: the production shell around the backends ``backend_factory`` builds, one per model version.

    ``settings`` needs chapter 2's knobs and :class:`ProductionOptions`; ``read_state`` turns a backend into the numbers
    ``/metrics`` reports; ``probe`` replaces the readiness probe; ``stream_writer`` serves ``"stream": true`` (the
    backends must stream); ``contract`` is what ``/v1/inference`` accepts; ``read_events`` finds what chapter 3's live
    page (its files in ``pages``) watches in the newest version's backend."""
    set_threads(settings.torch_threads)
    if settings.memory_snapshots and not tracemalloc.is_tracing():
        tracemalloc.start()  # costs every allocation some time: only behind the flag
    first = build_version(settings, settings.model_version, settings.weights, settings.seed, backend_factory)
    if stream_writer is not None and not hasattr(first.backend, "open_stream"):
        raise TypeError(f"{type(first.backend).__name__} does not stream (no open_stream), yet a stream writer was given")
    limits = settings.limits(first.loaded.config.vocab_size, first.loaded.config.n_ctx)
    registry = ModelRegistry(settings.max_unload_wait_s)
    drain = DrainController(settings.drain_timeout_s)

    def newest_backend() -> Backend:
        newest = registry.newest()
        if newest is None or newest.backend is None:
            raise RuntimeError("no model version is loaded")
        return newest.backend

    readiness = ReadinessProbe(probe or request_probe(newest_backend), settings.probe_interval_s, settings.probe_timeout_s)
    backend = ProductionBackend(settings, registry, first, drain, readiness, chapter)
    app = create_app(title=title, limits=limits, tokenizer=first.loaded.tokenizer, backend=backend, stream_writer=stream_writer,
                     contract=contract)
    device = first.loaded.model.device

    def serving() -> list[tuple]:
        return [(v.name, v.source, read_state(v.backend), v.in_flight) for v in list(registry.versions.values()) if v.backend is not None]

    metrics_registry, request_metrics = build_registry(
        StateCollector(serving, lambda: device, lambda: backend.readiness()[0]))
    app.add_middleware(RequestObserver, metrics=request_metrics)
    app.add_middleware(ClientChannel)
    app.state.production = backend
    app.state.drain = drain
    app.state.registry = registry
    app.state.metrics_registry = metrics_registry
    app.state.limits, app.state.tokenizer, app.state.first_source = limits, first.loaded.tokenizer, first.source
    LiveView(lambda: read_events(newest_backend()), pages).register(app)

    register_health_routes(app, backend, metrics_registry)
    register_admin_routes(app, settings, backend, registry, limits, backend_factory)
    return app


def register_health_routes(app: FastAPI, backend: ProductionBackend, metrics_registry: CollectorRegistry) -> None:
    """``/livez`` (the process answers), ``/readyz`` (a real request went through lately), ``/metrics``."""

    @app.get("/livez")
    async def livez() -> dict:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready, reason = backend.readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)


def register_admin_routes(app: FastAPI, settings: ProductionSettings, backend: ProductionBackend, registry: ModelRegistry,
                          limits: ContractLimits, backend_factory: BackendFactory) -> None:
    """``/admin/models``, behind the admin token: list the versions, load one (hot reload, the previous retired)."""

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer "):
            raise ApiError(401, "unauthorized", "send Authorization: Bearer <admin token>", {"WWW-Authenticate": "Bearer"})
        if not settings.admin_token or not hmac.compare_digest(given.removeprefix("Bearer ").encode(), settings.admin_token.encode()):
            raise ApiError(403, "forbidden", "the admin token is wrong (or the admin API is off: --admin-token)")

    @app.get("/admin/models")
    async def list_models(request: Request) -> dict:
        authorize(request)
        return {"versions": backend.health()["versions"], "unloaded": [vars(u) for u in registry.unloaded]}

    @app.post("/admin/models", status_code=201)
    async def load_version(request: Request) -> dict:
        authorize(request)
        try:
            asked = LoadRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", str(exc)) from None
        if asked.version in registry.versions:
            raise ApiError(409, "version_exists", f"model version {asked.version!r} is already loaded")
        started = time.perf_counter()
        try:
            version = await asyncio.to_thread(build_version, settings, asked.version, asked.weights, asked.seed, backend_factory)
        except (ValueError, FileNotFoundError) as exc:
            raise ApiError(422, "invalid_weights", str(exc)) from None
        config = version.loaded.config
        if (config.vocab_size, config.n_ctx) != (limits.vocab_size, limits.n_ctx):
            raise ApiError(422, "incompatible_model",
                           f"vocabulary {config.vocab_size} / context {config.n_ctx} differ from the served "
                           f"{limits.vocab_size} / {limits.n_ctx}: requests checked for one would not fit the other")
        await registry.add(version, retire_previous=asked.retire_previous)
        return {"version": version.name, "source": version.source, "load_s": round(time.perf_counter() - started, 3)}


def serve(app: FastAPI, settings: ServerSettings) -> None:
    """Run ``app`` (one built by :func:`build_app`) with uvicorn until SIGTERM, then drain it."""
    # keep idle connections longer than the load balancer in front does: closing first races a client reusing one
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, log_config=None, timeout_graceful_shutdown=5,
                            timeout_keep_alive=settings.keep_alive_s)
    server = DrainingServer(config, app.state.drain, app.state.live_view)
    freeze_startup_heap()  # the model, the routes, the imports: built once, never garbage
    server.run()
    if server.drain_report is not None and server.drain_report.cut_off:
        log.warning("exited with %d requests cut off by the drain timeout", server.drain_report.cut_off)


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch07_production"
    settings = parse_settings(ProductionSettings, argv, prog=prog)
    settings = or_meanwhile(lambda: apply_tuned_config(settings), lambda: settings, "tuned.json is ignored")
    configure_json_logging(settings.log_level)
    with refused_flags_exit(prog):  # a flag judged against the loaded model: one line, exit 2
        app = build_app(settings)
    serve(app, settings)


if __name__ == "__main__":
    main()
