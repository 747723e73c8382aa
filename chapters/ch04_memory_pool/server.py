"""Chapter 4: a KV-cache pool reserved at start-up, and admission control in front of the batcher.

A request's life: uvicorn parses HTTP on the event loop and the endpoint checks the body, as in
chapter 2. Then, new in this chapter, ADMISSION CONTROL decides at once: the request joins chapter
3's batcher queue if the queue has room; when it is full, the request is served on the CPU fallback
path outside the pool if the pool has been under pressure for a while, and otherwise gets 429 with
Retry-After. When a batch leaves the queue it reserves, from the POOL allocated at start-up, exactly
the range its padded keys and values span; chapter 3's batched generation writes them in place
there (nothing is allocated or copied per decode step), and the range goes back when the batch ends,
whether it returned or raised. One ledger of KV memory (the allocator), one queue, one way out of it.

``GET /stats`` shows the pool (blocks, bytes, the share reserved and the share written), the
admission figures, and the batcher.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import uvicorn
from fastapi import FastAPI
from pydantic import Field

from chapters.ch02_fastapi_async.api import DisconnectCheck, Generated, create_app
from chapters.ch03_dynamic_batching.batched_generation import Prefill, generate_batch
from chapters.ch03_dynamic_batching.batcher import BatchRunner, DynamicBatcher
from chapters.ch03_dynamic_batching.server import BatchedBackend, BatchingSettings
from chapters.ch04_memory_pool.admission import AdmissionConfig, AdmissionController, Route
from chapters.ch04_memory_pool.memory_pool import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_HEADROOM,
    BatchCacheLease,
    KVMemoryPool,
    PooledKVCache,
    pool_tokens_by_fraction,
    pool_tokens_by_rule,
)
from shared.devices import choose_device, set_threads
from shared.generation import greedy_generate
from shared.model import GPT, ModelConfig, StepModel
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
    max_queue: int = Field(100, ge=1, description="requests that may wait in the batcher's queue; beyond: 429")
    fallback_threshold: float = Field(0.9, gt=0.0, le=1.0, description="pool use that counts as pressure")
    fallback_after_s: float = Field(5.0, ge=0.0, description="after this long under pressure, what the full queue would refuse goes to the fallback")
    fallback_slots: int = Field(1, ge=0, description="requests on the CPU fallback at once (0: never offload)")


# ------------------------------------------------------------------------------------------------
# Sizing
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolPlan:
    capacity_tokens: int
    rule: str  # how the size was chosen, for /stats and the log


def plan_pool(settings: PoolSettings, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> PoolPlan:
    """How big the pool is: the article's rule by default.

    The longest sequence a request may reach is the context itself: the API accepts any prompt with
    ``prompt + max_new_tokens <= n_ctx``; that is the article's "peak per request". A pool must hold
    at least one such request, or some valid request could never run.
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
    return PoolPlan(capacity_tokens=capacity, rule=rule)


def cpu_copy(model: GPT) -> GPT:
    """The fallback's model: the same module on a CPU machine, an FP32 copy in host memory otherwise."""
    if model.device.type == "cpu":
        return model  # read-only weights can be shared by two threads
    copy = GPT(model.config)
    copy.load_state_dict({name: t.to("cpu", torch.float32) for name, t in model.state_dict().items()})
    return copy.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# The parts
# ------------------------------------------------------------------------------------------------


class PooledBatchRunner:
    """Chapter 3's batched generation with each batch's KV cache in a range of the pool.

    A batch reserves ``rows x (longest prompt + most new tokens - 1)`` token slots, rounded up to
    whole blocks, the moment it starts; a batch too large for the pool runs as consecutive groups
    that each fit. ``slots_reserved`` and ``slots_written`` count, over every batch, the slots taken
    and the slots that ended up holding a real token's key and value (the rest is left padding, the
    unused tail of rows that asked for fewer tokens, and rounding to blocks).
    """

    def __init__(self, model: StepModel, pool: KVMemoryPool, pad_id: int, prefill: Prefill) -> None:
        self.model, self.pool, self.pad_id, self.prefill = model, pool, pad_id, prefill
        self.slots_reserved = 0
        self.slots_written = 0

    def __call__(self, requests: list[ValidRequest]) -> list[Generated]:
        results: list[Generated] = []
        for group in self.groups_that_fit(requests):
            results += self._run_group(group)
        return results

    def groups_that_fit(self, requests: list[ValidRequest]) -> list[list[ValidRequest]]:
        """Consecutive groups whose padded cache fits the whole pool (one group is live at a time)."""
        groups: list[list[ValidRequest]] = [[]]
        longest = most_new = 0
        for request in requests:
            longest, most_new = max(longest, len(request.input_ids)), max(most_new, request.max_new_tokens)
            if groups[-1] and self.pool.blocks_for((len(groups[-1]) + 1) * (longest + most_new - 1)) > self.pool.allocator.total_blocks:
                groups.append([])
                longest, most_new = len(request.input_ids), request.max_new_tokens
            groups[-1].append(request)
        return groups

    def _run_group(self, requests: list[ValidRequest]) -> list[Generated]:
        # The lease takes the range back when generation ends, whether it returned or raised.
        with BatchCacheLease(self.pool) as lease:

            def reserve(batch_size: int, max_len: int) -> PooledKVCache:
                cache = lease.new_cache(batch_size, max_len)
                self.slots_reserved += cache.block_range.n_blocks * self.pool.block_tokens
                return cache

            rows = generate_batch(
                self.model, [r.input_ids for r in requests], [r.max_new_tokens for r in requests],
                self.pad_id, cache_factory=reserve, prefill=self.prefill,
            )
        self.slots_written += sum(len(r.input_ids) + r.max_new_tokens - 1 for r in requests)
        return [Generated(row.output_ids, row.timings_ms) for row in rows]

    def stats(self) -> dict:
        pool = self.pool.stats()
        return {
            "block_tokens": pool.block_tokens,
            "blocks_total": pool.blocks_total,
            "blocks_used": pool.blocks_used,
            "bytes_total": pool.bytes_total,
            "bytes_used": pool.bytes_used,
            "use": round(pool.use, 4),
            "live_ranges": pool.live_ranges,
            "free_ranges": pool.free_ranges,
            "largest_free_blocks": pool.largest_free_blocks,
            "slots_reserved_total": self.slots_reserved,
            "slots_written_total": self.slots_written,
            "written_share": round(self.slots_written / self.slots_reserved, 4) if self.slots_reserved else None,
        }


class CpuFallback:
    """The slow path outside the pool: one sequence at a time on an FP32 model in host memory."""

    def __init__(self, model: GPT, slots: int) -> None:
        self.model = cpu_copy(model)
        self._threads = ThreadPoolExecutor(max_workers=max(1, slots), thread_name_prefix="fallback")

    def _run(self, request: ValidRequest) -> Generated:
        started = time.perf_counter()
        output_ids = greedy_generate(self.model, request.input_ids, request.max_new_tokens)
        return Generated(output_ids, {"fallback": (time.perf_counter() - started) * 1e3})

    async def generate(self, request: ValidRequest) -> Generated:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._run, request)

    def close(self) -> None:
        self._threads.shutdown(wait=True)


class PooledBackend(BatchedBackend):
    """Chapter 3's batched backend behind admission control, its batches' KV caches in the pool."""

    def __init__(
        self,
        batcher: DynamicBatcher[ValidRequest, Generated],
        runner: PooledBatchRunner,
        admission: AdmissionController,
        fallback: CpuFallback | None,
        description: dict,
    ) -> None:
        super().__init__(batcher, description)
        self.runner, self.admission, self.fallback = runner, admission, fallback

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        arrived = time.perf_counter()
        route = self.admission.admit()  # raises 429 past the queue
        admitted = time.perf_counter()
        if route is Route.FALLBACK:
            try:
                result = await self.fallback.generate(request)
            finally:
                self.admission.fallback_done()
        else:
            try:
                result = await super().generate(request, is_disconnected)
            finally:
                self.admission.finished(time.perf_counter() - admitted)
        return Generated(result.output_ids, {"admission": (admitted - arrived) * 1e3, **result.timings_ms})

    def stats(self) -> dict:
        return {**self.health(), "pool": self.runner.stats(), "admission": self.admission.stats()}

    async def close(self) -> None:
        await super().close()
        if self.fallback is not None:
            self.fallback.close()


# ------------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------------


def build_app(settings: PoolSettings, run_batch: BatchRunner[ValidRequest, Generated] | None = None) -> FastAPI:
    """The server; ``run_batch`` replaces the pooled runner's ``__call__`` (tests hold batches with it)."""
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    pool = build_pool(settings, loaded.config, loaded.model.dtype, loaded.model.device)
    runner = PooledBatchRunner(loaded.model, pool, loaded.tokenizer.pad_id, settings.prefill)
    batcher = DynamicBatcher(run_batch or runner, settings.batcher_config())
    backend = PooledBackend(
        batcher, runner, admission_for(settings, batcher, pool),
        CpuFallback(loaded.model, settings.fallback_slots) if settings.fallback_slots else None,
        {"chapter": "ch04", "model": loaded.source, "prefill": settings.prefill},
    )
    return create_app(
        title="ch04 memory pool",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        backend=backend,
    )


def build_pool(settings: PoolSettings, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> KVMemoryPool:
    """The pool, sized by :func:`plan_pool`, allocated (and touched) now; its size logged."""
    plan = plan_pool(settings, config, dtype, device)
    pool = KVMemoryPool(config, plan.capacity_tokens, block_tokens=settings.block_tokens, device=device, dtype=dtype)
    log.info(
        "KV pool: %d token slots in %d blocks of %d, %.1f MiB of %s on %s (%s)",
        pool.capacity_tokens, pool.allocator.total_blocks, pool.block_tokens, pool.stats().bytes_total / 2**20,
        str(dtype).removeprefix("torch."), pool.device, plan.rule,
    )
    return pool


def admission_for(settings: PoolSettings, batcher: DynamicBatcher, pool: KVMemoryPool) -> AdmissionController:
    config = AdmissionConfig(
        max_waiting=settings.max_queue,
        pressure_threshold=settings.fallback_threshold,
        pressure_duration_s=settings.fallback_after_s,
        fallback_slots=settings.fallback_slots,
    )
    return AdmissionController(config, waiting=lambda: batcher.queued, pool_use=lambda: pool.stats().use)


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(PoolSettings, argv, prog="python -m chapters.ch04_memory_pool")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
