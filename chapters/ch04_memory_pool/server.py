"""Chapter 4: a KV-cache pool reserved at start-up, and admission control in front of the batcher.

A request's life: uvicorn parses HTTP on the event loop and the endpoint checks the body, as in
chapter 2. Then, new in this chapter, the request asks ADMISSION CONTROL for a reservation of pool
blocks. It gets one at once, or waits in a bounded queue until a finished request gives blocks
back; when the queue is full too, it is served on the CPU fallback path outside the pool if the pool
has been overloaded for a while, and otherwise gets 429 with Retry-After. An admitted request joins
chapter 3's batcher unchanged; the batch runs chapter 3's batched generation in the one inference
thread, but with a KV cache that lives in a range of the pool: keys and values are written in
place, and nothing is allocated or copied per decode step. When the batch ends its range goes back
to the pool, and when the response is sent the request's reservation goes back to admission control.

``GET /stats`` shows the pool (blocks and bytes), the reservations, the queue and the fallback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import Field

from chapters.ch02_fastapi_async.api import Generated, create_app
from chapters.ch03_dynamic_batching.batched_generation import generate_batch
from chapters.ch03_dynamic_batching.batcher import (
    BatcherConfig,
    BatchRunner,
    DynamicBatcher,
)
from chapters.ch03_dynamic_batching.server import BatchingSettings
from chapters.ch04_memory_pool.admission import (
    AdmissionConfig,
    AdmissionController,
    Route,
)
from chapters.ch04_memory_pool.memory_pool import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_HEADROOM,
    BatchCacheLease,
    KVMemoryPool,
    pool_tokens_by_fraction,
    pool_tokens_by_rule,
)
from shared.devices import choose_device, set_threads
from shared.generation import greedy_generate
from shared.model import GPT, ModelConfig
from shared.schemas import ValidRequest
from shared.settings import parse_settings
from shared.weights import load_model

log = logging.getLogger("chapters.ch04_memory_pool")


class PoolSettings(BatchingSettings):
    """Chapter 3's knobs plus the pool's and admission control's."""

    max_concurrency: int = Field(64, ge=1, description="requests expected in flight at once: the article's sizing rule")
    pool_headroom: float = Field(DEFAULT_HEADROOM, ge=1.0, description="the rule's headroom factor (the article: 1.2)")
    pool_tokens: int = Field(0, ge=0, description="pool size in token slots; overrides the rule (0: use the rule)")
    pool_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="size the pool as this share of free GPU memory / available RAM; overrides the rule (0: off)",
    )
    block_tokens: int = Field(DEFAULT_BLOCK_TOKENS, ge=1, description="token slots per allocator block")
    max_queue: int = Field(100, ge=0, description="requests that may wait for pool blocks; beyond: 429")
    fallback_threshold: float = Field(0.9, gt=0.0, le=1.0, description="pool use that counts as pressure")
    fallback_after_s: float = Field(5.0, ge=0.0, description="after this long under pressure, what the full queue would refuse goes to the fallback")
    fallback_slots: int = Field(1, ge=0, description="requests on the CPU fallback at once (0: never offload)")
    stats_log_interval_s: float = Field(10.0, gt=0.0, description="how often the pool's figures are logged while busy")


# ------------------------------------------------------------------------------------------------
# Sizing
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolPlan:
    capacity_tokens: int
    reservation_tokens: int  # what one request reserves: its longest possible sequence
    rule: str  # how the size was chosen, for /stats and the log


def plan_pool(settings: PoolSettings, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> PoolPlan:
    """How big the pool is and what one request reserves in it.

    The longest sequence a request may reach is the context itself: the API accepts any prompt with
    ``prompt + max_new_tokens <= n_ctx``. Reserving that for every request is the article's "peak per
    request at the longest sequence", and it is what makes a padded batch always fit (admission.py).
    """
    longest = config.n_ctx
    if settings.pool_tokens:
        capacity, rule = settings.pool_tokens, f"--pool-tokens {settings.pool_tokens}"
    elif settings.pool_fraction:
        capacity = pool_tokens_by_fraction(settings.pool_fraction, config, dtype, device)
        rule = f"{settings.pool_fraction:.0%} of available {device.type} memory"
    else:
        capacity = pool_tokens_by_rule(longest, settings.max_concurrency, settings.pool_headroom)
        rule = f"{longest} tokens x {settings.max_concurrency} requests x {settings.pool_headroom} headroom"
    if capacity < longest:
        raise ValueError(f"a pool of {capacity} token slots cannot hold one request of {longest} positions ({rule})")
    return PoolPlan(capacity_tokens=capacity, reservation_tokens=longest, rule=rule)


def cpu_copy(model: GPT) -> GPT:
    """The fallback's model: the same module on a CPU machine, an FP32 copy in host memory otherwise."""
    if model.device.type == "cpu":
        return model  # read-only weights can be shared by two threads
    copy = GPT(model.config)
    copy.load_state_dict({name: t.to("cpu", torch.float32) for name, t in model.state_dict().items()})
    return copy.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------------


def build_app(
    settings: PoolSettings,
    run_batch: BatchRunner[ValidRequest, Generated] | None = None,
    *,
    chapter: str = "ch04",
    prepare_model: Callable[[GPT], GPT] | None = None,
    make_batcher: Callable[[BatchRunner, BatcherConfig], DynamicBatcher] = DynamicBatcher,
) -> FastAPI:
    """The server; ``run_batch`` replaces the pooled batch function (tests hold batches with it).

    Hook for chapter 5: ``prepare_model`` turns the loaded model into what the batches run (an
    inference engine with the model's call signature, ``config``, ``device`` and ``dtype``); the
    pool takes that object's dtype. ``chapter`` names the server in ``/healthz``.
    Hook for chapter 6: ``make_batcher`` builds the batcher from the batch runner and its config.
    """
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    batch_model = prepare_model(loaded.model) if prepare_model else loaded.model
    plan = plan_pool(settings, loaded.config, batch_model.dtype, loaded.model.device)
    pool = KVMemoryPool(
        loaded.config, plan.capacity_tokens, block_tokens=settings.block_tokens,
        device=loaded.model.device, dtype=batch_model.dtype,
    )
    reservation_blocks = pool.blocks_for(plan.reservation_tokens)
    admission = AdmissionController(AdmissionConfig(
        capacity_blocks=pool.allocator.total_blocks,
        max_waiting=settings.max_queue,
        pressure_threshold=settings.fallback_threshold,
        pressure_duration_s=settings.fallback_after_s,
        fallback_slots=settings.fallback_slots,
    ))
    log.info(
        "KV pool: %d token slots in %d blocks of %d, %.1f MiB on %s (%s); requests that fit at once: %d",
        pool.capacity_tokens, pool.allocator.total_blocks, pool.block_tokens, pool.stats().bytes_total / 2**20,
        pool.device, plan.rule, pool.allocator.total_blocks // reservation_blocks,
    )

    def run_pooled(requests: list[ValidRequest]) -> list[Generated]:
        # The lease takes the batch's range back when generation ends, whether it returned or raised.
        with BatchCacheLease(pool) as lease:
            rows = generate_batch(
                batch_model, [r.input_ids for r in requests], [r.max_new_tokens for r in requests],
                loaded.tokenizer.pad_id, cache_factory=lease.new_cache, prefill=settings.prefill,
            )
        return [Generated(row.output_ids, row.timings_ms) for row in rows]

    batcher = make_batcher(run_batch or run_pooled, settings.batcher_config())
    fallback_model = cpu_copy(loaded.model) if settings.fallback_slots else None
    fallback_threads = ThreadPoolExecutor(max_workers=max(1, settings.fallback_slots), thread_name_prefix="fallback")

    def run_fallback(request: ValidRequest) -> Generated:
        started = time.perf_counter()
        output_ids = greedy_generate(fallback_model, request.input_ids, request.max_new_tokens)
        return Generated(output_ids, {"fallback": (time.perf_counter() - started) * 1e3})

    async def generate(request: ValidRequest, is_disconnected) -> Generated:
        arrived = time.perf_counter()
        ticket = await admission.admit(reservation_blocks)  # may wait; raises 429 past the queue
        admitted = time.perf_counter()
        try:
            if ticket.route is Route.FALLBACK:
                result = await asyncio.get_running_loop().run_in_executor(fallback_threads, run_fallback, request)
            else:
                result = await batcher.submit(request, is_disconnected)
        finally:
            admission.release(ticket)
        in_batcher_ms = (time.perf_counter() - admitted) * 1e3
        timings = {"admission": (admitted - arrived) * 1e3, **result.timings_ms}
        if ticket.route is Route.POOL:
            timings["queue"] = in_batcher_ms - result.timings_ms.get("batch", 0.0)
        return Generated(result.output_ids, timings)

    def stats() -> dict:
        pool_stats = pool.stats()
        return {
            "chapter": chapter,
            "pool": {
                "rule": plan.rule,
                "device": str(pool.device),
                "block_tokens": pool_stats.block_tokens,
                "blocks_total": pool_stats.blocks_total,
                "blocks_used": pool_stats.blocks_used,
                "bytes_total": pool_stats.bytes_total,
                "bytes_used": pool_stats.bytes_used,
                "use": round(pool_stats.use, 4),
                "live_ranges": pool_stats.live_ranges,
                "free_ranges": pool_stats.free_ranges,
                "largest_free_blocks": pool_stats.largest_free_blocks,
                "reservation_blocks": reservation_blocks,
            },
            "admission": admission.stats(),
            "batcher": batcher.describe(),
        }

    async def log_stats_while_busy() -> None:
        while True:
            await asyncio.sleep(settings.stats_log_interval_s)
            figures = admission.stats()
            if figures["admitted"] or figures["waiting"] or figures["fallback_in_flight"]:
                log.info(
                    "pool reserved %.0f%% (%d/%d blocks), in use %d blocks; %d admitted, %d waiting; "
                    "%d rejected, %d served on the fallback so far",
                    100 * figures["reserved_use"], figures["reserved_blocks"], figures["capacity_blocks"],
                    pool.stats().blocks_used, figures["admitted"], figures["waiting"],
                    figures["rejected_total"], figures["fallback_served_total"],
                )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        stats_logger = asyncio.create_task(log_stats_while_busy(), name="pool-stats-log")
        yield
        # SIGTERM: uvicorn stops accepting and waits for in-flight requests (queued ones included,
        # they are in flight for uvicorn); then the batcher drains and the threads are released.
        stats_logger.cancel()
        await batcher.close()
        fallback_threads.shutdown(wait=True)

    app = create_app(
        title=f"{chapter} memory pool",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        generate=generate,
        health=lambda: {"chapter": chapter, "model": loaded.source, "prefill": settings.prefill, "batcher": batcher.describe(),
                        **({"engine": batch_model.describe()} if hasattr(batch_model, "describe") else {})},
        lifespan=lifespan,
    )

    @app.get("/stats")
    async def stats_endpoint() -> dict:
        return stats()

    app.state.pool, app.state.admission, app.state.batcher = pool, admission, batcher  # for tests
    return app


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(PoolSettings, argv, prog="python -m chapters.ch04_memory_pool")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
