"""Chapter 8: continuous batching over a paged KV cache, token streaming, an OpenAI-compatible API.

A request's life: uvicorn parses HTTP on the event loop and the endpoint checks the body (chapter
2's contract). Admission is immediate: 429 with Retry-After once ``max_num_seqs + max_queue``
requests are in flight, else the request becomes a SEQUENCE handed to the ENGINE THREAD
(:mod:`~chapters.ch08_continuous_batching.engine`), which turns chapter 3's step loop with a
step-level scheduler (:mod:`~chapters.ch08_continuous_batching.scheduler`): at EVERY step, waiting
sequences join (chunked prefill under a token budget), every running one gets a token, finished
ones leave at once. The step is ONE packed forward pass of chapter 5's engine (whatever its rule
chose on this machine) over exactly the tokens it computes
(:mod:`~chapters.ch08_continuous_batching.model_runner`), and attention reads the paged cache
through the block tables (:mod:`~chapters.ch08_continuous_batching.paged_attention`, ``--attention``).
Keys and values live in fixed-size blocks of chapter 4's pool, one block table
per sequence (:mod:`~chapters.ch08_continuous_batching.paged_cache`), allocated as the policy says:
``--kv-policy grow`` (block by block; preempt the newest sequence by recompute when none is free) or
``reserve`` (the whole prompt + max_new_tokens at admission; never preempts).

Each token is pushed to its request as soon as the step that made it ends: ``/v1/inference`` with
``"stream": true`` and ``/v1/completions`` with ``"stream": true`` send it as a server-sent event.
A client that goes away (a closed stream, or a disconnect noticed by polling for the JSON routes) or
a request past ``--request-timeout-s`` (504) is aborted between two steps: its blocks are free
before the next step is planned, and nobody else notices.

Routes: chapter 2's ``/healthz``, ``/stats``, ``/v1/inference`` (here replaced by a version that also
streams, same contract otherwise), plus ``/v1/completions`` and ``/v1/models``
(:mod:`~chapters.ch08_continuous_batching.openai_api`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import Field, model_validator

from chapters.ch02_fastapi_async.api import DisconnectCheck, Generated, create_app, inference_openapi, read_body
from chapters.ch03_dynamic_batching.batcher import ClientDisconnected
from chapters.ch04_memory_pool.memory_pool import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_HEADROOM,
    KVMemoryPool,
    pool_tokens_by_fraction,
    pool_tokens_by_rule,
)
from chapters.ch05_inference_engine.server import EngineOptions, engine_for
from chapters.ch08_continuous_batching.engine import EngineLoop, Finished, RequestStream
from chapters.ch08_continuous_batching.model_runner import ModelRunner, PackedModel, packed_model
from chapters.ch08_continuous_batching.openai_api import CompletionsApi
from chapters.ch08_continuous_batching.paged_attention import ATTENTION_CHOICES, choose_attention
from chapters.ch08_continuous_batching.paged_cache import KV_CACHE_DTYPES, KV_CACHE_RULE, PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, KVPolicy, SchedulerConfig, Sequence
from chapters.ch08_continuous_batching.streaming import SSE_HEADERS, TextDelta, sse
from shared.devices import choose_device, set_threads
from shared.model import ModelConfig
from shared.schemas import (
    REQUEST_ID_HEADER,
    ApiError,
    ContractLimits,
    InferenceResponse,
    ValidRequest,
    build_response,
    parse_inference_request,
    request_id_from,
)
from shared.settings import ServerSettings, parse_settings
from shared.tokenizer import Tokenizer
from shared.weights import load_model

log = logging.getLogger("chapters.ch08_continuous_batching")


class ContinuousSettings(ServerSettings, EngineOptions):
    """Chapter 2's knobs, chapter 5's engine, the scheduler's budgets, the paged pool's size and policy,
    the attention backend, deadlines."""

    max_num_seqs: int = Field(64, ge=1, description="sequences running at once (rows of a decode step)")
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens one step computes: decodes + prefill chunks")
    kv_policy: KVPolicy = Field("grow", description="grow: blocks as needed, preempt by recompute | reserve: prompt + max_new at admission")
    block_tokens: int = Field(DEFAULT_BLOCK_TOKENS, ge=1, description="token slots per KV block")
    attention: ATTENTION_CHOICES = Field("auto", description="paged attention backend: auto (measured, paged_attention.py) | gather | flex")
    kv_cache_dtype: KV_CACHE_DTYPES = Field("auto", description=f"dtype of the paged pool's keys and values: {KV_CACHE_RULE} | fp32 | bf16")
    pool_tokens: int = Field(0, ge=0, description="KV pool size in token slots (0: context x max_num_seqs x headroom, chapter 4's rule)")
    pool_fraction: float = Field(0.0, ge=0.0, le=1.0, description="size the pool as this share of free memory; overrides the rule (0: off)")
    pool_headroom: float = Field(DEFAULT_HEADROOM, ge=1.0, description="the sizing rule's headroom factor")
    max_queue: int = Field(256, ge=0, description="requests that may wait beyond max_num_seqs; beyond that: 429")
    request_timeout_s: float = Field(0.0, ge=0.0, description="a request still unfinished after this long gets 504 (0: no deadline)")
    disconnect_poll_ms: float = Field(50.0, gt=0.0, description="how often a non-streaming request checks that its client is still there")
    served_model_name: str = Field("", description="the model's name in /v1/models and /v1/completions (empty: the weights' name)")

    @model_validator(mode="after")
    def _budget_covers_decodes(self) -> ContinuousSettings:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})")
        return self

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.kv_policy)


def pool_capacity(settings: ContinuousSettings, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[int, str]:
    """Token slots of the KV pool, and the rule that chose them (at least one whole context)."""
    if settings.pool_tokens:
        capacity, rule = settings.pool_tokens, f"--pool-tokens {settings.pool_tokens}"
    elif settings.pool_fraction:
        capacity = pool_tokens_by_fraction(settings.pool_fraction, config, dtype, device)
        rule = f"{settings.pool_fraction:.0%} of available {device.type} memory"
    else:
        capacity = pool_tokens_by_rule(config.n_ctx, settings.max_num_seqs, settings.pool_headroom)
        rule = f"{config.n_ctx} tokens x {settings.max_num_seqs} sequences x {settings.pool_headroom} headroom"
    needed = math.ceil(config.n_ctx / settings.block_tokens) * settings.block_tokens
    if capacity < needed:
        raise ValueError(f"a pool of {capacity} token slots cannot hold one sequence of {config.n_ctx} positions ({rule})")
    return capacity, rule


class ContinuousBackend:
    """Chapter 2's :class:`~chapters.ch02_fastapi_async.api.Backend` over the engine thread, plus streams."""

    def __init__(self, engine: EngineLoop, *, max_in_flight: int, request_timeout_s: float, disconnect_poll_s: float, description: dict) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.request_timeout_s = request_timeout_s
        self.disconnect_poll_s = disconnect_poll_s
        self.description = description
        self.in_flight = 0
        self.rejected = 0
        self.cancelled = 0
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        self.engine.start(asyncio.get_running_loop())

    def open(self, request: ValidRequest) -> RequestStream:
        """Admit ``request`` now (or raise 503/429) and hand it to the engine; returns its token stream."""
        if self._closing:
            raise ApiError(503, "draining", "the server is shutting down")
        if self.in_flight >= self.max_in_flight:
            self.rejected += 1
            raise ApiError(429, "overloaded", f"{self.in_flight} requests in flight; retry later", {"Retry-After": "1"})
        now = time.perf_counter()
        deadline = now + self.request_timeout_s if self.request_timeout_s else None
        stream = self.engine.submit(Sequence(list(request.input_ids), request.max_new_tokens, arrived=now, deadline=deadline))
        self.in_flight += 1
        self._idle.clear()
        stream.result.add_done_callback(self._done)
        return stream

    def _done(self, _future: asyncio.Future) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def cancel(self, stream: RequestStream) -> None:
        """The client is gone: abort its sequence (its blocks are free after the current step)."""
        if not stream.result.done():
            self.cancelled += 1
            self.engine.cancel(stream.seq, ClientDisconnected())

    async def wait(self, stream: RequestStream, is_disconnected: DisconnectCheck) -> Finished:
        """The whole result; polls ``is_disconnected`` meanwhile (a JSON route has no other way to learn it)."""
        try:
            while not stream.result.done():
                await asyncio.wait({stream.result}, timeout=self.disconnect_poll_s)
                if not stream.result.done() and await is_disconnected():
                    self.cancel(stream)
                    break
            finished = await stream.result
        except asyncio.CancelledError:  # the handler was cancelled (the server is going away under it)
            self.cancel(stream)
            raise
        if finished.error is not None:
            raise finished.error
        return finished

    @asynccontextmanager
    async def streaming(self, stream: RequestStream) -> AsyncIterator[None]:
        """Around a streamed response: whatever way it ends early (closed connection, cancelled task), abort."""
        try:
            yield
        finally:
            self.cancel(stream)

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        finished = await self.wait(self.open(request), is_disconnected)
        return Generated(finished.output_ids, finished.timings_ms)

    def health(self) -> dict:
        return dict(self.description)

    def stats(self) -> dict:
        return {
            **self.description,
            "in_flight": self.in_flight,
            "rejected": self.rejected,
            "cancelled": self.cancelled,
            "failed_steps": self.engine.failed_steps,
            "scheduler": self.engine.scheduler.describe(),
            "steps": self.engine.clock.describe(),
        }

    async def close(self) -> None:
        self._closing = True
        await self._idle.wait()  # uvicorn already stopped accepting; let what was accepted finish
        await asyncio.to_thread(self.engine.stop)


def add_streaming_inference(app: FastAPI, backend: ContinuousBackend, tokenizer: Tokenizer, limits: ContractLimits) -> None:
    """Replace chapter 2's ``/v1/inference`` with one that also accepts ``"stream": true`` (server-sent events).

    Chapter 2's route parses the body itself and refuses unknown fields, so ``stream`` cannot pass
    through it: this route takes ``stream`` out, then checks the rest with the same contract code.
    Without ``stream`` (or with ``false``) the answer is chapter 2's, byte for byte the same JSON.
    """
    app.router.routes[:] = [r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path == "/v1/inference")]
    openapi = inference_openapi()
    openapi["requestBody"]["content"]["application/json"]["schema"]["properties"]["stream"] = {"type": "boolean", "default": False}

    @app.post("/v1/inference", response_model=InferenceResponse, openapi_extra=openapi)
    async def inference(request: Request):
        started = time.perf_counter()
        request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        request.state.request_id = request_id
        body = await read_body(request, limits.max_body_bytes)
        body, stream_wanted = _take_stream_flag(body)
        valid = parse_inference_request(body, limits, tokenizer)
        parsed = time.perf_counter()
        stream = backend.open(valid)
        headers = {REQUEST_ID_HEADER: request_id}
        if stream_wanted:
            events = _inference_events(backend, stream, tokenizer, request_id, len(valid.input_ids), started, parsed)
            return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        finished = await backend.wait(stream, request.is_disconnected)
        timings = {"parse": (parsed - started) * 1e3, **finished.timings_ms, "total": (time.perf_counter() - started) * 1e3}
        response = build_response(request_id, len(valid.input_ids), finished.output_ids, tokenizer, timings)
        return JSONResponse(response.model_dump(), headers=headers)


def _take_stream_flag(body: bytes) -> tuple[bytes, bool]:
    """``body`` without its ``stream`` field, and that field; invalid JSON is left for the contract's parser (400)."""
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return body, False
    if not isinstance(raw, dict) or "stream" not in raw:
        return body, False
    flag = raw.pop("stream")
    if not isinstance(flag, bool):
        raise ApiError(422, "invalid_request", f"stream: must be true or false, got {flag!r}")
    return json.dumps(raw).encode(), flag


async def _inference_events(
    backend: ContinuousBackend, stream: RequestStream, tokenizer: Tokenizer, request_id: str, prompt_len: int, started: float, parsed: float
) -> AsyncIterator[bytes]:
    text = TextDelta(tokenizer)
    async with backend.streaming(stream):
        async for event in stream.tokens():
            if not isinstance(event, Finished):
                yield sse({"token_id": event, "text": text.add(event)}, event="token")
                continue
            if event.error is not None:
                yield sse(event.error.body(), event="error")
                return
            timings = {"parse": (parsed - started) * 1e3, **event.timings_ms, "total": (time.perf_counter() - started) * 1e3}
            yield sse(build_response(request_id, prompt_len, event.output_ids, tokenizer, timings).model_dump(), event="done")


def served_name(source: str) -> str:
    """A short model name from the loader's description: ``default:tiny-default.safetensors`` -> ``tiny-default``."""
    return Path(source.rsplit(":", 1)[-1]).stem or source


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_app(settings: ContinuousSettings, wrap_model: Callable[[PackedModel], PackedModel] | None = None) -> FastAPI:
    """The server; ``wrap_model`` wraps what the engine calls (tests hold or fail steps with it)."""
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    step_engine = engine_for(settings, loaded)  # chapter 5: its rule's choice, or the one named
    model = packed_model(step_engine)
    kv_dtype = kv_cache_dtype(settings.kv_cache_dtype, step_engine.precision, step_engine.dtype)
    capacity, rule = pool_capacity(settings, loaded.config, kv_dtype, step_engine.device)
    pool = KVMemoryPool(loaded.config, capacity, block_tokens=settings.block_tokens, device=step_engine.device, dtype=kv_dtype)
    store = PagedKVStore(pool)
    log.info(
        "paged KV pool: %d blocks of %d tokens in %s, %.1f MiB on %s (%s), policy %s",
        store.manager.total_blocks, store.block_tokens, _dtype_name(kv_dtype), pool.stats().bytes_total / 2**20, pool.device,
        rule, settings.kv_policy,
    )
    attention = choose_attention(settings.attention, store, model, settings.max_num_seqs)
    scheduler = ContinuousScheduler(store, settings.scheduler_config())
    runner = ModelRunner(wrap_model(model) if wrap_model else model, store, attention)
    engine = EngineLoop(runner, scheduler)
    model_name = settings.served_model_name or served_name(loaded.source)
    backend = ContinuousBackend(
        engine,
        max_in_flight=settings.max_num_seqs + settings.max_queue,
        request_timeout_s=settings.request_timeout_s,
        disconnect_poll_s=settings.disconnect_poll_ms / 1e3,
        description={"chapter": "ch08", "model": loaded.source, "kv_policy": settings.kv_policy, "pool_rule": rule,
                     "engine": step_engine.describe(), "attention": attention.name, "kv_cache_dtype": _dtype_name(kv_dtype)},
    )
    limits = settings.limits(loaded.config.vocab_size, loaded.config.n_ctx)
    app = create_app(title="ch08 continuous batching", limits=limits, tokenizer=loaded.tokenizer, backend=backend)
    add_streaming_inference(app, backend, loaded.tokenizer, limits)
    CompletionsApi(backend, loaded.tokenizer, limits, model_name).register(app)
    app.state.engine = engine
    return app


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(ContinuousSettings, argv, prog="python -m chapters.ch08_continuous_batching")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
