"""The ``cudagraph`` engine: the decode step recorded once as CUDA graphs over static buffers, replayed every step.

Each step has fixed shapes (a *batch bucket* of rows, padded up to; a *length bucket* of key columns) over buffers
allocated once, the keys and values one range of a chapter 4 pool. Prefill stays eager. The engine's own cache
(:meth:`CudaGraphEngine.new_cache`) is written in place; any other :class:`~shared.model.KVCache` is copied in once per
batch and kept in step. A batch larger than the largest bucket raises :class:`BatchTooLarge`.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from chapters.ch02_fastapi_async.api import Generated
from chapters.ch03_dynamic_batching.batched_generation import Prefill, generate_batch
from chapters.ch04_memory_pool.memory_pool import BlockRange, KVMemoryPool
from chapters.ch04_memory_pool.pooled_backend import PooledBatchRunner
from chapters.ch05_inference_engine.engine import (
    ConversionReport,
    Engine,
    EngineUnavailable,
    _activation_dtype,
    _check_16bit_supported,
    cast_model,
)
from shared.model import DecoderModel, KVCache
from shared.schemas import ValidRequest

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Key columns a step attends over: attention reads every column of its bucket, masked or not.
DEFAULT_LENGTH_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 1024)
SUPPORTED_PRECISIONS = ("fp32", "fp16", "bf16")


class BatchTooLarge(ValueError):
    """More rows than the largest batch bucket: the caller must send smaller batches."""


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``n``; :class:`BatchTooLarge` when even the largest does not."""
    if n < 1:
        raise ValueError(f"need at least one row or column, got {n}")
    index = bisect.bisect_left(buckets, n)
    if index == len(buckets):
        raise BatchTooLarge(f"{n} exceeds the largest bucket ({buckets[-1]}); send at most {buckets[-1]} rows per batch")
    return buckets[index]


def length_buckets_for(max_len: int, candidates: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> tuple[int, ...]:
    """The candidates below ``max_len``, and ``max_len`` itself (the last bucket covers every length)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    return tuple(sorted({c for c in candidates if c < max_len} | {max_len}))


def batch_buckets_for(max_rows: int, candidates: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> tuple[int, ...]:
    """The candidates below ``max_rows``, and ``max_rows`` itself (the last bucket holds the largest batch)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    return tuple(sorted({c for c in candidates if c < max_rows} | {max_rows}))


def static_shape_in(pool: KVMemoryPool, max_batch: int) -> tuple[tuple[int, ...], int]:
    """``(batch buckets, max_len)`` of an engine whose static buffers are one range of ``pool``: ``max_len`` the model's
    context, the rows ``max_batch`` or as many such sequences as the pool's largest free range holds, if fewer (a larger
    batch then runs in groups). Raises ValueError when that range cannot hold one sequence."""
    max_len = pool.config.n_ctx
    fit = pool.stats().largest_free_blocks * pool.block_tokens // max_len
    if fit < 1:
        raise ValueError(f"the pool's largest free range cannot hold one sequence of {max_len} positions")
    return batch_buckets_for(min(max_batch, fit)), max_len


def cudagraph_unavailable_reason(precision: str, device: torch.device) -> str | None:
    """Why the ``cudagraph`` engine cannot run at ``precision`` on ``device``, or None."""
    if device.type != "cuda":
        return (f"CUDA graphs record and replay CUDA kernel launches, so they need a CUDA device (this is {device.type});"
                " the same static-shape step runs uncaptured on the CPU only in the tests")
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if precision not in SUPPORTED_PRECISIONS:
        return f"the cudagraph engine runs {'/'.join(SUPPORTED_PRECISIONS)} (cast weights); {precision} is not captured"
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    return None


class StaticSlotCache:
    """A :class:`~shared.model.KVCache` whose keys and values ARE the engine's static buffers (rows ``:batch_size``).
    Closed when the engine hands out the next cache or adopts another: using it afterwards raises."""

    def __init__(self, engine: CudaGraphEngine, batch_size: int, max_len: int) -> None:
        self.engine = engine
        self.batch_size = batch_size
        self.max_len = max_len
        self._seq_len = 0
        self.closed = False

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this cache was closed: the engine's static buffers now hold another batch")

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self._check_open()
        end = self._seq_len + key.shape[2]
        if key.shape[0] != self.batch_size or end > self.max_len:
            raise ValueError(f"cache holds {self.batch_size} rows x {self.max_len} positions; got {key.shape[0]} rows up to {end}")
        keys = self.engine.static_keys[layer][: self.batch_size]
        values = self.engine.static_values[layer][: self.batch_size]
        keys[:, :, self._seq_len : end].copy_(key)
        values[:, :, self._seq_len : end].copy_(value)
        return keys[:, :, :end], values[:, :, :end]

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        self._check_open()
        rows = slice(0, self.batch_size)
        return (self.engine.static_keys[layer][rows, :, : self._seq_len],
                self.engine.static_values[layer][rows, :, : self._seq_len])

    def advance(self, n_tokens: int) -> None:
        self._check_open()
        self._seq_len += n_tokens


class CudaGraphEngine(Engine):
    """Decode through static-shape steps of the (cast) ``module``, captured as CUDA graphs (``capture=True``) or run
    directly. ``max_len`` (the longest sequence a batch may reach) defaults to the model's context; the static keys and
    values are one range of ``pool`` (in this engine's dtype), or of a pool made for them when it is None."""

    name = "cudagraph"

    def __init__(
        self,
        module: DecoderModel,
        precision: str,
        *,
        capture: bool,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        length_buckets: Sequence[int] | None = None,
        max_len: int | None = None,
        pool: KVMemoryPool | None = None,
    ) -> None:
        config, device = module.config, module.device
        super().__init__(config, device, self.dtype_for(precision, device), ConversionReport())
        if capture and device.type != "cuda":
            raise EngineUnavailable(cudagraph_unavailable_reason(precision, device) or "capture needs CUDA")
        self.precision = precision
        self.module = module
        self.captured = capture
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.max_len = max_len or config.n_ctx
        if self.max_len > config.n_ctx:
            raise ValueError(f"max_len {self.max_len} exceeds the model's context of {config.n_ctx}")
        self.length_buckets = length_buckets_for(self.max_len, length_buckets or DEFAULT_LENGTH_BUCKETS)
        self.max_rows = self.batch_buckets[-1]
        self.stats = {"graph_replays": 0, "uncaptured_static_steps": 0, "eager_steps": 0, "adoptions": 0}

        # The static KV buffers: one pool range, viewed per layer as (max_rows, H_kv, max_len, D).
        slots = self.max_rows * self.max_len
        self.pool = pool if pool is not None else KVMemoryPool(config, slots, block_tokens=self.max_len, device=device, dtype=self.dtype)
        if self.pool.dtype != self.dtype or self.pool.device != device:
            raise ValueError(f"the pool holds {self.pool.dtype} on {self.pool.device}; this engine needs {self.dtype} on {device}")
        self.block_range: BlockRange = self.pool.allocator.allocate(self.pool.blocks_for(slots))
        shape = (self.max_rows, config.kv_heads, self.max_len, config.head_dim)
        self.static_keys = [self.pool.plane(self.block_range, layer, 0, slots).view(shape) for layer in range(config.n_layer)]
        self.static_values = [self.pool.plane(self.block_range, layer, 1, slots).view(shape) for layer in range(config.n_layer)]

        # The other static inputs and the output. The mask covers the whole static length.
        self._ids = torch.zeros((self.max_rows, 1), dtype=torch.long, device=device)
        self._positions = torch.zeros((self.max_rows, 1), dtype=torch.long, device=device)
        self._mask = torch.zeros((self.max_rows, 1, 1, self.max_len), dtype=torch.bool, device=device)
        self._write_column = torch.zeros((1,), dtype=torch.long, device=device)
        self._logits = torch.zeros((self.max_rows, config.vocab_size), dtype=torch.float32, device=device)

        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._live_cache: StaticSlotCache | None = None
        # Which foreign cache the static rows hold, and at how many positions (see _adopt).
        self._resident: tuple[weakref.ref, int] | None = None

    @staticmethod
    def dtype_for(precision: str, device: torch.device) -> torch.dtype:
        """The dtype of the static keys and values at ``precision``: a pool handed in must hold it."""
        return _activation_dtype(precision, device)

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        """Eager (prompt lengths vary); with this engine's own cache the keys and values land in the static buffers."""
        if cache is not None and cache.seq_len != 0:
            raise ValueError(f"prefill needs an empty cache; this one holds {cache.seq_len} positions")
        return self._eager(input_ids, position_ids, attention_mask, cache)

    @torch.no_grad()
    def decode(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache) -> Tensor:
        """One token per row through the static step of the row and length buckets that hold it."""
        rows, new_tokens = input_ids.shape
        past = cache.seq_len
        if past == 0:
            raise ValueError("decode needs a cache that holds the prompt: call prefill first")
        if new_tokens != 1:
            # several tokens per row is not a captured shape
            self.stats["eager_steps"] += 1
            return self._eager(input_ids, position_ids, attention_mask, cache)
        bucket = bucket_for(rows, self.batch_buckets)
        if past + 1 > self.max_len:
            raise ValueError(f"a sequence of {past + 1} positions exceeds this engine's static length of {self.max_len}")
        columns = bucket_for(past + 1, self.length_buckets)
        own = isinstance(cache, StaticSlotCache) and cache.engine is self
        if own:
            cache._check_open()
            if rows != cache.batch_size:
                raise ValueError(f"the cache holds {cache.batch_size} rows, the step has {rows}")
        else:
            self._adopt(cache, rows, past)
        self._load_inputs(input_ids, position_ids, attention_mask, rows, bucket, past, columns)
        logits = self._run(bucket, columns)[:rows].clone()  # the static output is overwritten by the next step
        if own:
            cache.advance(1)
        else:
            self._store_back(cache, rows, past)
        return logits

    def new_cache(self, batch_size: int, max_len: int) -> StaticSlotCache:
        """A cache for ``batch_size`` rows of up to ``max_len`` positions inside the static buffers (chapter 3's
        ``cache_factory``); closes the one handed out before."""
        bucket_for(batch_size, self.batch_buckets)  # refuses a batch larger than the largest bucket
        if max_len > self.max_len:
            raise ValueError(f"{max_len} positions exceed this engine's static length of {self.max_len}")
        self._close_live_cache()
        self._resident = None
        self._live_cache = StaticSlotCache(self, batch_size, max_len)
        return self._live_cache

    def describe(self) -> dict:
        return super().describe() | {"captured": self.captured, "batch_buckets": list(self.batch_buckets),
                                     "length_buckets": list(self.length_buckets), "max_len": self.max_len}

    def close(self) -> None:
        """Give the static range back to the pool (the engine cannot decode afterwards)."""
        self._close_live_cache()
        self._graphs.clear()
        self.static_keys, self.static_values = [], []
        self.pool.free(self.block_range)

    def _static_step(self, rows: int, columns: int) -> None:
        """One decode step for ``rows`` rows over ``columns`` key columns, only through the static buffers: what a graph
        records. The model's pieces, not its forward, whose mask comes from the cache's Python ``seq_len``."""
        model = self.module
        mask = self._mask[:rows, :, :, :columns]
        positions = self._positions[:rows]
        grouped = self.config.kv_heads != self.config.n_head  # each key/value head serves several query heads
        x = model.embed(self._ids[:rows], positions)
        for layer, block in enumerate(model.blocks):
            q, k, v = block.attention_inputs(x, positions)
            keys, values = self.static_keys[layer][:rows], self.static_values[layer][:rows]
            keys.index_copy_(2, self._write_column, k)
            values.index_copy_(2, self._write_column, v)
            y = F.scaled_dot_product_attention(q, keys[:, :, :columns], values[:, :, :columns], attn_mask=mask,
                                               enable_gqa=grouped)
            x = block.after_attention(x, y)
        self._logits[:rows].copy_(model.head(x)[:, -1, :])

    def _run(self, bucket: int, columns: int) -> Tensor:
        if self.captured:
            self._graphs[(bucket, columns)].replay()
            self.stats["graph_replays"] += 1
        else:
            self._static_step(bucket, columns)
            self.stats["uncaptured_static_steps"] += 1
        return self._logits

    def _load_inputs(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None,
                     rows: int, bucket: int, past: int, columns: int) -> None:
        """Copy the step's inputs into the static buffers; rows ``rows:bucket`` become padding."""
        self._ids[:rows].copy_(input_ids)
        if position_ids is None:
            self._positions[:rows].fill_(past)
        else:
            self._positions[:rows].copy_(position_ids.reshape(rows, 1))
        mask = self._mask[:bucket, 0, 0, :columns]
        mask.zero_()
        if attention_mask is None:
            mask[:rows, : past + 1] = True
        else:
            if attention_mask.shape != (rows, past + 1):
                raise ValueError(f"attention_mask is {tuple(attention_mask.shape)}, expected ({rows}, {past + 1})")
            mask[:rows, : past + 1].copy_(attention_mask.bool())
        if bucket > rows:
            # padding rows: token 0 at position 0, seeing only their own new key (a fully masked row's softmax is NaN)
            self._ids[rows:bucket].zero_()
            self._positions[rows:bucket].zero_()
            mask[rows:, past] = True
        self._write_column.fill_(past)

    def _adopt(self, cache: KVCache, rows: int, past: int) -> None:
        """Make the static rows hold ``cache``'s ``past`` positions, copying them unless they already do."""
        if rows > self.max_rows:
            raise BatchTooLarge(f"{rows} rows exceed the largest bucket ({self.max_rows})")
        if self._resident is not None and self._resident[0]() is cache and self._resident[1] == past:
            return
        self._close_live_cache()
        for layer in range(self.config.n_layer):
            keys, values = cache.read(layer)
            self.static_keys[layer][:rows, :, :past].copy_(keys)
            self.static_values[layer][:rows, :, :past].copy_(values)
        self.stats["adoptions"] += 1
        self._resident = (weakref.ref(cache), past)

    def _store_back(self, cache: KVCache, rows: int, past: int) -> None:
        """Store the step's new key and value (column ``past``) in the foreign cache too."""
        for layer in range(self.config.n_layer):
            cache.update(layer, self.static_keys[layer][:rows, :, past : past + 1],
                         self.static_values[layer][:rows, :, past : past + 1])
        cache.advance(1)
        self._resident = (weakref.ref(cache), past + 1)

    def _close_live_cache(self) -> None:
        if self._live_cache is not None:
            self._live_cache.closed = True
            self._live_cache = None

    def _eager(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        if cache is not None and not isinstance(cache, StaticSlotCache):
            self._resident = None  # the foreign cache changes outside the static rows
        logits = self.module(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, last_token_only=True)
        return logits[:, -1, :].float()

    def capture_all(self) -> int:
        """Record one CUDA graph per (batch bucket, length bucket), largest first, in one memory pool; returns how many."""
        if not self.captured:
            raise EngineUnavailable("this engine was built with capture=False")
        memory_pool = torch.cuda.graph_pool_handle()
        self._mask[:, :, :, 0] = True  # the capture's own runs must not see a fully masked row
        self._write_column.zero_()
        for bucket in reversed(self.batch_buckets):
            for columns in reversed(self.length_buckets):
                self._graphs[(bucket, columns)] = self._capture(bucket, columns, memory_pool)
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

    @torch.no_grad()
    def _capture(self, bucket: int, columns: int, memory_pool: object) -> torch.cuda.CUDAGraph:
        # warm up on a side stream first (cuBLAS handles, kernel selection), as torch's docs require
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._static_step(bucket, columns)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=memory_pool):
            self._static_step(bucket, columns)
        return graph


def build_cudagraph(
    model: DecoderModel,
    precision: str,
    *,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    length_buckets: Sequence[int] | None = None,
    max_len: int | None = None,
    pool: KVMemoryPool | None = None,
) -> CudaGraphEngine:
    """The ``cudagraph`` engine for ``model`` at ``precision``, every graph captured; :class:`EngineUnavailable` off CUDA."""
    reason = cudagraph_unavailable_reason(precision, model.device)
    if reason:
        raise EngineUnavailable(f"cudagraph/{precision}: {reason}")
    _check_16bit_supported(precision, model.device)
    started = time.perf_counter()
    module = model if precision == "fp32" else cast_model(model, precision)
    engine = CudaGraphEngine(module.eval(), precision, capture=True, batch_buckets=batch_buckets,
                             length_buckets=length_buckets, max_len=max_len, pool=pool)
    captured = engine.capture_all()
    kv_bytes = 2 * engine.config.n_layer * engine.static_keys[0].numel() * engine.static_keys[0].element_size()
    engine.conversion = ConversionReport(
        seconds=time.perf_counter() - started,
        notes=[(f"{captured} CUDA graphs of the decode step: batch buckets {list(engine.batch_buckets)} x length buckets "
                f"{list(engine.length_buckets)}; static keys and values: {kv_bytes} bytes in one pool range; prefill eager")],
    )
    return engine


class StaticCacheRunner(PooledBatchRunner):
    """Chapter 4's runner for a :class:`CudaGraphEngine` built on the runner's pool, each batch's cache the engine's own, in
    groups of at most ``engine.max_rows`` rows; ``slots_reserved`` counts the rows x positions their caches span."""

    def __init__(self, engine: CudaGraphEngine, pad_id: int, prefill: Prefill) -> None:
        super().__init__(engine, engine.pool, pad_id, prefill)
        self.engine = engine

    def groups_that_fit(self, requests: list[ValidRequest]) -> list[list[ValidRequest]]:
        rows = self.engine.max_rows
        return [requests[start : start + rows] for start in range(0, len(requests), rows)]

    def _run_group(self, requests: list[ValidRequest]) -> list[Generated]:
        def static_cache(batch_size: int, max_len: int) -> StaticSlotCache:
            self.slots_reserved += batch_size * max_len
            return self.engine.new_cache(batch_size, max_len)

        rows = generate_batch(
            self.model, [r.input_ids for r in requests], [r.max_new_tokens for r in requests],
            self.pad_id, cache_factory=static_cache, prefill=self.prefill,
        )
        self.slots_written += sum(len(r.input_ids) + r.max_new_tokens - 1 for r in requests)
        return rows
