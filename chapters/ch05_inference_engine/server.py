"""Chapter 5: chapter 4's server, its batches computed by an inference engine at a chosen precision.

A request's life is chapter 4's; its steps run on the engine that ``--engine`` and ``--precision`` name, over one pool in
the engine's dtype (the ``cudagraph`` engine's static buffers are a range of it). The oracle's exact tokens are a promise
of ``--precision fp32`` only; the CPU fallback stays on the eager fp32 model.
"""

from __future__ import annotations

import logging
from typing import Literal

from fastapi import FastAPI
from pydantic import Field
from pydantic_settings import BaseSettings

from chapters.ch02_fastapi_async.api import create_app
from chapters.ch03_dynamic_batching.live_view import LiveView, request_row, serve
from chapters.ch03_dynamic_batching.batcher import DynamicBatcher
from chapters.ch04_memory_pool.pooled_backend import CpuFallback, PooledBackend, PooledBatchRunner
from chapters.ch03_dynamic_batching.server import BatcherOptions
from chapters.ch04_memory_pool.server import AdmissionOptions, PoolOptions, admission_for, build_pool
from chapters.ch05_inference_engine.cudagraph_engine import CudaGraphEngine, StaticCacheRunner, build_cudagraph, static_shape_in
from chapters.ch05_inference_engine.engine import Engine
from chapters.ch05_inference_engine.engines import build_engine, resolve_engine
from shared.devices import set_threads
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.unwritten import or_meanwhile
from shared.weights import LoadedModel, load_served_model

log = logging.getLogger("chapters.ch05_inference_engine")


class EngineOptions(BaseSettings):
    """The engine and its precision: an option group any server that runs chapter 5's engine composes."""

    model_config = ServerSettings.model_config

    engine: Literal["auto", "eager", "compile", "onnxruntime", "tensorrt", "cudagraph"] = Field(
        "auto", description="what runs the model: auto = the measured rule (engines.py); with a named precision, eager"
    )
    precision: Literal["auto", "fp32", "fp16", "bf16", "int8"] = Field(
        "auto", description="auto = the measured rule (engines.py); with a named engine, fp32; fp32 returns the oracle's tokens"
    )


class EngineSettings(EngineOptions, PoolOptions, AdmissionOptions, BatcherOptions, ServerSettings):
    """Chapter 4's knobs plus the engine and its precision."""


def engine_for(settings: EngineOptions, loaded: LoadedModel) -> Engine:
    """The engine the settings ask for; fails at start-up, with the reason, rather than serve another."""
    return announced(or_meanwhile(lambda: build_engine(loaded.model, settings.engine, settings.precision),
                                  lambda: build_engine(loaded.model, "eager", "fp32"), "the engine is eager/fp32"))


def announced(engine: Engine) -> Engine:
    cost = engine.conversion
    log.info("engine %s on %s: ready in %.1f s%s", engine.label, engine.device, cost.seconds,
             " (artifacts from the cache)" if cost.from_cache else "")
    return engine


def runner_for(settings: EngineSettings, loaded: LoadedModel) -> PooledBatchRunner:
    """The engine the settings ask for (as :func:`engine_for`) and chapter 4's runner over the one pool."""
    return or_meanwhile(
        lambda: pooled_runner(settings, loaded, *resolve_engine(loaded.model, settings.engine, settings.precision)),
        lambda: pooled_runner(settings, loaded, "eager", "fp32"), "the engine is eager/fp32")


def pooled_runner(settings: EngineSettings, loaded: LoadedModel, name: str, precision: str) -> PooledBatchRunner:
    """Engine ``name`` at ``precision`` (already resolved) and the runner over the one pool."""
    model, pad_id = loaded.model, loaded.tokenizer.pad_id
    if name != "cudagraph":
        engine = announced(build_engine(model, name, precision))
        pool = build_pool(settings, settings.max_concurrency, loaded.config, engine.dtype, engine.device)
        return PooledBatchRunner(engine, pool, pad_id, settings.prefill)
    dtype = CudaGraphEngine.dtype_for(precision, model.device)
    pool = build_pool(settings, settings.max_concurrency, loaded.config, dtype, model.device)
    batch_buckets, max_len = static_shape_in(pool, settings.max_batch)
    if batch_buckets[-1] < settings.max_batch:
        log.warning("the pool holds %d sequences of %d positions, fewer than --max-batch %d: a larger batch runs in groups",
                    batch_buckets[-1], max_len, settings.max_batch)
    engine = announced(build_cudagraph(model, precision, batch_buckets=batch_buckets, max_len=max_len, pool=pool))
    return StaticCacheRunner(engine, pad_id, settings.prefill)


def build_app(settings: EngineSettings) -> FastAPI:
    set_threads(settings.torch_threads)
    loaded = load_served_model(settings)
    runner = runner_for(settings, loaded)
    batcher = DynamicBatcher(runner, settings.batcher_config(), describe_row=request_row)
    backend = PooledBackend(
        batcher, runner, admission_for(settings, batcher, runner.pool),
        CpuFallback(loaded.model, settings.fallback_slots) if settings.fallback_slots else None,
        {"chapter": "ch05", "model": loaded.source, "prefill": settings.prefill, "engine": runner.model.describe()},
    )
    app = create_app(
        title="ch05 inference engine",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        backend=backend,
    )
    LiveView(lambda: batcher.events).register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch05_inference_engine"
    settings = parse_settings(EngineSettings, argv, prog=prog)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    with refused_flags_exit(prog):  # a flag judged against the loaded model: one line, exit 2
        app = build_app(settings)
    serve(app, settings)


if __name__ == "__main__":
    main()
