"""Chapter 4's KV-cache pool: sizing, a thread-safe first-fit block allocator, one tensor whose ranges hold batches' caches."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from dataclasses import dataclass

import psutil
import torch
from torch import Tensor

from shared.model import ModelConfig

DEFAULT_BLOCK_TOKENS = 16
DEFAULT_HEADROOM = 1.2  # the sizing rule's factor on top of "peak per request x concurrency"


def kv_bytes_per_request(config: ModelConfig, longest_tokens: int, dtype: torch.dtype) -> int:
    """KV-cache bytes one request holds at ``longest_tokens`` positions: exact, and the only part of its peak the pool stores."""
    return longest_tokens * config.kv_bytes_per_token(dtype)


def pool_tokens_by_rule(longest_tokens: int, max_concurrency: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """Token slots: longest sequence x maximum concurrency x headroom, rounded up; ValueError unless all are >= 1."""
    # EXERCISE ch04.3 BEGIN "the article's sizing rule"
    if longest_tokens < 1 or max_concurrency < 1 or headroom < 1.0:
        raise ValueError("longest_tokens and max_concurrency must be >= 1, headroom >= 1.0")
    return math.ceil(longest_tokens * max_concurrency * headroom)


def available_memory_bytes(device: torch.device) -> int:
    """Free GPU memory on CUDA; on the CPU psutil's ``available`` (obtainable without swapping, shared with every process)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available


def pool_tokens_by_fraction(fraction: float, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Token slots that fit in ``fraction`` of :func:`available_memory_bytes`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(available_memory_bytes(device) * fraction) // config.kv_bytes_per_token(dtype)


class PoolExhausted(Exception):
    """No free range is large enough right now. Admission control turns this into waiting."""


class InvalidFree(ValueError):
    """A range was handed back that this allocator does not consider live."""


class DoubleFree(InvalidFree):
    """The range was allocated here and has already been freed."""


class ForeignFree(InvalidFree):
    """The range was never handed out by this allocator (another allocator's, or made up)."""


@dataclass(frozen=True)
class BlockRange:
    """A live allocation: ``n_blocks`` consecutive blocks from ``start``. ``allocation_id`` is unique per allocation (a stale
    handle is caught, not freed again); ``owner_id`` names the allocator that issued it."""

    start: int
    n_blocks: int
    allocation_id: int
    owner_id: int

    @property
    def end(self) -> int:
        return self.start + self.n_blocks


class BlockAllocator:
    """First-fit allocation of block ranges from ``total_blocks``, with a sorted, coalesced free list; every operation locks.
    Invariants: free ranges are sorted by start, never overlap, never touch, and with the live ranges cover ``[0, total_blocks)``
    exactly once; ``used_blocks`` is the sum of live ranges. Allocation is O(free ranges); free, a binary search and an insert."""

    _owner_ids = itertools.count(1)

    def __init__(self, total_blocks: int) -> None:
        if total_blocks < 1:
            raise ValueError(f"an allocator needs at least one block, got {total_blocks}")
        self.total_blocks = total_blocks
        self._owner_id = next(self._owner_ids)
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0]  # sorted; parallel to _free_sizes
        self._free_sizes: list[int] = [total_blocks]
        self._live: dict[int, BlockRange] = {}  # start block -> the live range there
        self._next_allocation_id = 1
        self._used_blocks = 0

    def try_allocate(self, n_blocks: int) -> BlockRange | None:
        """The lowest-addressed free range of ``n_blocks`` blocks, or None when none is large enough."""
        if n_blocks < 1:
            raise ValueError(f"allocate at least one block, got {n_blocks}")
        # EXERCISE ch04.1 BEGIN "first fit: the lowest-addressed free range that is large enough"
        with self._lock:
            for index, size in enumerate(self._free_sizes):
                if size >= n_blocks:
                    return self._take(index, n_blocks)
            return None

    def allocate(self, n_blocks: int) -> BlockRange:
        """Like :meth:`try_allocate`, but raise :class:`PoolExhausted` instead of returning None."""
        taken = self.try_allocate(n_blocks)
        if taken is None:
            raise PoolExhausted(f"no free range of {n_blocks} blocks ({self.free_blocks} free, largest {self.largest_free_range})")
        return taken

    def _take(self, index: int, n_blocks: int) -> BlockRange:
        """Cut ``n_blocks`` from free range ``index``; record the live range and the used count."""
        # EXERCISE ch04.1 BEGIN "first fit: the lowest-addressed free range that is large enough"
        # Cut from the front of the free range: the remainder keeps its place in the sorted list.
        start = self._free_starts[index]
        if self._free_sizes[index] == n_blocks:
            del self._free_starts[index], self._free_sizes[index]
        else:
            self._free_starts[index] += n_blocks
            self._free_sizes[index] -= n_blocks
        taken = BlockRange(start, n_blocks, self._next_allocation_id, self._owner_id)
        self._next_allocation_id += 1
        self._live[start] = taken
        self._used_blocks += n_blocks
        return taken

    def free(self, block_range: BlockRange) -> None:
        """Return a live range. Raise :class:`DoubleFree` or :class:`ForeignFree` for anything else."""
        with self._lock:
            self._check_live(block_range)
            del self._live[block_range.start]
            self._used_blocks -= block_range.n_blocks
            self._insert_and_merge(block_range.start, block_range.n_blocks)

    def _check_live(self, block_range: BlockRange) -> None:
        if block_range.owner_id != self._owner_id or block_range.allocation_id >= self._next_allocation_id:
            raise ForeignFree(f"{block_range} was not allocated by this allocator")
        if self._live.get(block_range.start) != block_range:
            raise DoubleFree(f"{block_range} was already freed")

    def _insert_and_merge(self, start: int, size: int) -> None:
        """Put ``size`` free blocks at ``start`` back in the sorted free list, merged with touching neighbours."""
        # EXERCISE ch04.2 BEGIN "coalescing free: merge a returned range with its free neighbours"
        index = bisect.bisect_left(self._free_starts, start)
        merges_left = index > 0 and self._free_starts[index - 1] + self._free_sizes[index - 1] == start
        merges_right = index < len(self._free_starts) and start + size == self._free_starts[index]
        if merges_left and merges_right:  # the freed range bridges two free ranges: one remains
            self._free_sizes[index - 1] += size + self._free_sizes[index]
            del self._free_starts[index], self._free_sizes[index]
        elif merges_left:
            self._free_sizes[index - 1] += size
        elif merges_right:
            self._free_starts[index] = start
            self._free_sizes[index] += size
        else:
            self._free_starts.insert(index, start)
            self._free_sizes.insert(index, size)

    @property
    def used_blocks(self) -> int:
        return self._used_blocks

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self._used_blocks

    @property
    def largest_free_range(self) -> int:
        with self._lock:
            return max(self._free_sizes, default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(start, n_blocks) of every free range, in address order."""
        with self._lock:
            return list(zip(self._free_starts, self._free_sizes))

    def live_ranges(self) -> list[BlockRange]:
        with self._lock:
            return sorted(self._live.values(), key=lambda r: r.start)


@dataclass(frozen=True)
class PoolStats:
    block_tokens: int
    blocks_total: int
    blocks_used: int
    bytes_total: int
    bytes_used: int
    live_ranges: int
    free_ranges: int  # more than one while something is live means the free space is split
    largest_free_blocks: int

    @property
    def use(self) -> float:
        return self.blocks_used / self.blocks_total


class KVMemoryPool:
    """Every request's keys and values, in one tensor allocated (and touched) at start-up.
    Storage: ``(n_layer, 2, capacity_tokens, kv_width)`` (keys, values; ``kv_width`` = kv heads x head width). A block is
    ``block_tokens`` slots; a range of blocks is the same rows in every (layer, key/value) plane, contiguous within each."""

    def __init__(
        self,
        config: ModelConfig,
        capacity_tokens: int,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.config = config
        self.block_tokens = block_tokens
        self.allocator = BlockAllocator(max(1, math.ceil(capacity_tokens / block_tokens)))
        self.capacity_tokens = self.allocator.total_blocks * block_tokens
        # zeros, not empty: every page is touched now, so no request pays a first-write page fault later.
        self.storage = torch.zeros(
            (config.n_layer, 2, self.capacity_tokens, config.kv_width), device=device, dtype=dtype
        )
        self.bytes_per_block = block_tokens * config.kv_bytes_per_token(dtype)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def blocks_for(self, n_tokens: int) -> int:
        """Whole blocks needed for ``n_tokens`` token slots (at least 1)."""
        return max(1, math.ceil(n_tokens / self.block_tokens))

    def free(self, block_range: BlockRange) -> None:
        self.allocator.free(block_range)

    def plane(self, block_range: BlockRange, layer: int, kv: int, n_tokens: int) -> Tensor:
        """The first ``n_tokens`` slots of ``block_range`` in one (layer, key=0/value=1) plane: a view."""
        if n_tokens > block_range.n_blocks * self.block_tokens:
            raise ValueError(f"{n_tokens} tokens do not fit in {block_range.n_blocks} blocks")
        first = block_range.start * self.block_tokens
        return self.storage[layer, kv, first : first + n_tokens]

    def new_cache(self, batch_size: int, max_len: int) -> PooledKVCache:
        """A cache for ``batch_size`` rows of up to ``max_len`` positions; raise PoolExhausted if none fits."""
        block_range = self.allocator.allocate(self.blocks_for(batch_size * max_len))
        return PooledKVCache(self, block_range, batch_size, max_len)

    def stats(self) -> PoolStats:
        free_ranges = self.allocator.free_ranges()
        used = self.allocator.used_blocks
        return PoolStats(
            block_tokens=self.block_tokens,
            blocks_total=self.allocator.total_blocks,
            blocks_used=used,
            bytes_total=self.allocator.total_blocks * self.bytes_per_block,
            bytes_used=used * self.bytes_per_block,
            live_ranges=len(self.allocator.live_ranges()),
            free_ranges=len(free_ranges),
            largest_free_blocks=max((size for _, size in free_ranges), default=0),
        )


class PooledKVCache:
    """A :class:`shared.model.KVCache` for one batch, living in one range of a :class:`KVMemoryPool`.
    Each (layer, key/value) plane is viewed as ``(B, H, max_len, D)``; ``update`` copies the new positions in place and returns
    a view of ``[:, :, :seq_len + T]``. :meth:`close` (or ``with``) returns the range; a closed cache raises RuntimeError."""

    def __init__(self, pool: KVMemoryPool, block_range: BlockRange, batch_size: int, max_len: int) -> None:
        config = pool.config
        self.pool = pool
        self.block_range: BlockRange | None = block_range
        self.batch_size = batch_size
        self.max_len = max_len
        shape = (batch_size, config.kv_heads, max_len, config.head_dim)
        n_slots = batch_size * max_len
        self._keys = [pool.plane(block_range, layer, 0, n_slots).view(shape) for layer in range(config.n_layer)]
        self._values = [pool.plane(block_range, layer, 1, n_slots).view(shape) for layer in range(config.n_layer)]
        self._seq_len = 0

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if self.block_range is None:
            raise RuntimeError("this cache was closed: its blocks belong to the pool again")
        end = self._seq_len + key.shape[2]
        if key.shape[0] != self.batch_size or end > self.max_len:
            raise ValueError(f"cache holds {self.batch_size} rows x {self.max_len} positions; got {key.shape[0]} rows up to {end}")
        keys, values = self._keys[layer], self._values[layer]
        keys[:, :, self._seq_len : end].copy_(key)
        values[:, :, self._seq_len : end].copy_(value)
        return keys[:, :, :end], values[:, :, :end]

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        if self.block_range is None:
            raise RuntimeError("this cache was closed: its blocks belong to the pool again")
        return self._keys[layer][:, :, : self._seq_len], self._values[layer][:, :, : self._seq_len]

    def advance(self, n_tokens: int) -> None:
        self._seq_len += n_tokens

    def close(self) -> None:
        """Give the blocks back (idempotent: closing twice is not a double free, the pool sees one)."""
        if self.block_range is not None:
            block_range, self.block_range = self.block_range, None
            self._keys, self._values = [], []
            self.pool.free(block_range)

    def __enter__(self) -> PooledKVCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BatchCacheLease:
    """Lends pool caches to one call of chapter 3's ``generate_batch`` and takes them all back after.
    A new cache closes the previous one (one live range per batch); leaving ``with`` returns the last, even on error."""

    def __init__(self, pool: KVMemoryPool) -> None:
        self.pool = pool
        self._current: PooledKVCache | None = None

    def new_cache(self, batch_size: int, max_len: int) -> PooledKVCache:
        self.close()
        self._current = self.pool.new_cache(batch_size, max_len)
        return self._current

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

    def __enter__(self) -> BatchCacheLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
