"""Chapter 4: a KV-cache pool reserved at start-up, and admission control in front of the batcher; ``/stats`` shows both."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from fastapi import FastAPI
from pydantic import Field
from pydantic_settings import BaseSettings

from chapters.ch02_fastapi_async.api import Generated, create_app
from chapters.ch03_dynamic_batching.live_view import LiveView, request_row, serve
from chapters.ch03_dynamic_batching.batcher import BatchRunner, DynamicBatcher
from chapters.ch03_dynamic_batching.server import BatcherOptions
from chapters.ch04_memory_pool.admission import AdmissionConfig, AdmissionController
from chapters.ch04_memory_pool.memory_pool import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_HEADROOM,
    KVMemoryPool,
    pool_tokens_by_fraction,
    pool_tokens_by_rule,
)
from chapters.ch04_memory_pool.pooled_backend import CpuFallback, PooledBackend, PooledBatchRunner
from shared.devices import set_threads
from shared.model import ModelConfig
from shared.schemas import ValidRequest
from shared.settings import ServerSettings, SettingsError, parse_settings, refused_flags_exit
from shared.unwritten import or_meanwhile
from shared.weights import load_served_model

log = logging.getLogger("chapters.ch04_memory_pool")


class PoolOptions(BaseSettings):
    """The KV pool's size and block: an option group any server with chapter 4's pool composes."""

    model_config = ServerSettings.model_config

    pool_headroom: float = Field(DEFAULT_HEADROOM, ge=1.0, description="the sizing rule's headroom factor (the article: 1.2)")
    pool_tokens: int = Field(0, ge=0, description="pool size in token slots; overrides the rule (0: use the rule)")
    pool_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="size the pool as this share of free GPU memory / available RAM; overrides the rule (0: off)",
    )
    block_tokens: int = Field(DEFAULT_BLOCK_TOKENS, ge=1, description="token slots per allocator block")


class AdmissionOptions(BaseSettings):
    """Admission control for a request-level batcher over the pool, and its CPU fallback: an option group chapters 4-7 compose."""

    model_config = ServerSettings.model_config

    max_concurrency: int = Field(64, ge=1, description="requests expected in flight at once: the article's sizing rule")
    max_queue: int = Field(100, ge=1, description="requests that may wait (accepted, not computing yet); beyond: 429")
    fallback_threshold: float = Field(0.9, gt=0.0, le=1.0, description="pool use that counts as pressure")
    fallback_after_s: float = Field(5.0, ge=0.0, description="after this long under pressure, what the full queue would refuse goes to the fallback")
    fallback_slots: int = Field(1, ge=0, description="requests on the CPU fallback at once (0: never offload)")


class PoolSettings(PoolOptions, AdmissionOptions, BatcherOptions, ServerSettings):
    """Chapter 3's knobs plus the pool's and admission control's."""


@dataclass(frozen=True)
class PoolPlan:
    capacity_tokens: int
    rule: str  # how the size was chosen, for /stats and the log


def plan_pool(settings: PoolOptions, concurrency: int, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> PoolPlan:
    """How big the pool is: ``--pool-tokens``, ``--pool-fraction``, else the sizing rule for ``concurrency`` requests at n_ctx.
    Raises SettingsError when the pool cannot hold one request at the full context (some valid request could never run)."""
    longest = config.n_ctx
    if settings.pool_tokens:
        capacity, rule = settings.pool_tokens, f"--pool-tokens {settings.pool_tokens}"
    elif settings.pool_fraction:
        capacity = pool_tokens_by_fraction(settings.pool_fraction, config, dtype, device)
        rule = f"{settings.pool_fraction:.0%} of available {device.type} memory"
    else:
        capacity = or_meanwhile(lambda: pool_tokens_by_rule(longest, concurrency, settings.pool_headroom),
                                lambda: longest * concurrency, "the pool holds every request at the full context, no headroom")
        rule = f"{longest} tokens x {concurrency} requests x {settings.pool_headroom} headroom"
    if capacity < longest:
        raise SettingsError(f"a pool of {capacity} token slots cannot hold one request of {longest} positions ({rule})")
    return PoolPlan(capacity_tokens=capacity, rule=rule)


def build_app(settings: PoolSettings, run_batch: BatchRunner[ValidRequest, Generated] | None = None) -> FastAPI:
    """The server; ``run_batch`` replaces the pooled runner's ``__call__`` (tests hold batches with it)."""
    set_threads(settings.torch_threads)
    loaded = load_served_model(settings)
    pool = build_pool(settings, settings.max_concurrency, loaded.config, loaded.model.dtype, loaded.model.device)
    runner = PooledBatchRunner(loaded.model, pool, loaded.tokenizer.pad_id, settings.prefill)
    batcher = DynamicBatcher(run_batch or runner, settings.batcher_config(), describe_row=request_row)
    backend = PooledBackend(
        batcher, runner, admission_for(settings, batcher, pool),
        CpuFallback(loaded.model, settings.fallback_slots) if settings.fallback_slots else None,
        {"chapter": "ch04", "model": loaded.source, "prefill": settings.prefill},
    )
    app = create_app(
        title="ch04 memory pool",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        backend=backend,
    )
    LiveView(lambda: batcher.events).register(app)
    return app


def build_pool(settings: PoolOptions, concurrency: int, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> KVMemoryPool:
    """The pool, sized by :func:`plan_pool` for ``concurrency`` requests, allocated (and touched) now; its size logged."""
    plan = plan_pool(settings, concurrency, config, dtype, device)
    pool = KVMemoryPool(config, plan.capacity_tokens, block_tokens=settings.block_tokens, device=device, dtype=dtype)
    log.info(
        "KV pool: %d token slots in %d blocks of %d, %.1f MiB of %s on %s (%s)",
        pool.capacity_tokens, pool.allocator.total_blocks, pool.block_tokens, pool.stats().bytes_total / 2**20,
        str(dtype).removeprefix("torch."), pool.device, plan.rule,
    )
    return pool


def admission_for(settings: AdmissionOptions, batcher: DynamicBatcher, pool: KVMemoryPool) -> AdmissionController:
    config = AdmissionConfig(
        max_waiting=settings.max_queue,
        pressure_threshold=settings.fallback_threshold,
        pressure_duration_s=settings.fallback_after_s,
        fallback_slots=settings.fallback_slots,
    )
    return AdmissionController(config, waiting=lambda: batcher.queued, pool_use=lambda: pool.stats().use)


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch04_memory_pool"
    settings = parse_settings(PoolSettings, argv, prog=prog)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    with refused_flags_exit(prog):  # a flag judged against the loaded model: one line, exit 2
        app = build_app(settings)
    serve(app, settings)


if __name__ == "__main__":
    main()
