"""Chapter 4's parts: the batched runner whose KV caches live in the pool, the CPU fallback, the backend behind admission."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from chapters.ch02_fastapi_async.api import DisconnectCheck, Generated
from chapters.ch03_dynamic_batching.batched_generation import Prefill, generate_batch
from chapters.ch03_dynamic_batching.batcher import DynamicBatcher
from chapters.ch03_dynamic_batching.server import BatchedBackend
from chapters.ch04_memory_pool.admission import AdmissionController, Route
from chapters.ch04_memory_pool.memory_pool import BatchCacheLease, KVMemoryPool, PooledKVCache
from shared.generation import greedy_generate
from shared.model import GPT, StepModel
from shared.schemas import ValidRequest


def cpu_copy(model: GPT) -> GPT:
    """The fallback's model: the same module on a CPU machine, an FP32 copy in host memory otherwise."""
    if model.device.type == "cpu":
        return model  # read-only weights can be shared by two threads
    copy = GPT(model.config)
    copy.load_state_dict({name: t.to("cpu", torch.float32) for name, t in model.state_dict().items()})
    return copy.eval().requires_grad_(False)


class PooledBatchRunner:
    """Chapter 3's batched generation with each batch's KV cache in a range of the pool.
    A batch reserves ``rows x (longest prompt + most new tokens - 1)`` slots in whole blocks as it starts; one too large for the
    pool runs as consecutive groups that fit. ``slots_reserved`` / ``slots_written``: slots taken / holding a real token."""

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
        return rows

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
