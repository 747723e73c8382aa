"""Chapter 4's pool: the allocator's invariants (hypothesis), the pooled KV cache's tokens and its zero allocations."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from chapters.ch03_dynamic_batching.batched_generation import generate_batch
from chapters.ch04_memory_pool.memory_pool import (
    BlockAllocator,
    BlockRange,
    DoubleFree,
    ForeignFree,
    KVMemoryPool,
    PooledKVCache,
    PoolExhausted,
    pool_tokens_by_fraction,
    pool_tokens_by_rule,
)
from shared.generation import greedy_generate
from shared.model import PRESETS, DynamicKVCache, KVCache
from shared.tokenizer import PAD_ID
from shared.weights import LoadedModel

# ---------------------------------------------------------------------------------------------
# The allocator
# ---------------------------------------------------------------------------------------------

# An operation: allocate n blocks, or free the i-th live range (modulo how many are live).
operations = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(1, 12)), st.tuples(st.just("free"), st.integers(0, 1000))),
    max_size=60,
)


def check_invariants(allocator: BlockAllocator, live: list[BlockRange]) -> None:
    """Live ranges and free ranges tile [0, total) exactly once; free ranges are sorted and merged."""
    pieces = [(r.start, r.n_blocks) for r in live] + allocator.free_ranges()
    covered = sorted(pieces)
    position = 0
    for start, size in covered:
        assert start == position, f"gap or overlap at block {position}: {covered}"
        assert size >= 1
        position += size
    assert position == allocator.total_blocks
    free = allocator.free_ranges()
    assert free == sorted(free)
    assert all(a_start + a_size < b_start for (a_start, a_size), (b_start, _) in itertools.pairwise(free)), "unmerged neighbours"
    assert allocator.used_blocks == sum(r.n_blocks for r in live)
    assert 0 <= allocator.used_blocks <= allocator.total_blocks


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 64), ops=operations)
def test_random_alloc_and_free_keep_every_invariant(total: int, ops: list[tuple[str, int]]) -> None:
    allocator = BlockAllocator(total)
    live: list[BlockRange] = []
    for kind, value in ops:
        if kind == "alloc":
            taken = allocator.try_allocate(value)
            if taken is None:
                assert allocator.largest_free_range < value  # None only when truly nothing fits
            else:
                assert taken.n_blocks == value and 0 <= taken.start and taken.end <= total
                live.append(taken)
        elif live:
            allocator.free(live.pop(value % len(live)))
        check_invariants(allocator, live)
    for block_range in live:
        allocator.free(block_range)
    assert allocator.free_ranges() == [(0, total)]
    assert allocator.used_blocks == 0


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 8), min_size=1, max_size=10), data=st.data())
def test_double_free_and_stale_handles_raise_and_change_nothing(sizes: list[int], data: st.DataObject) -> None:
    allocator = BlockAllocator(sum(sizes))
    live = [allocator.allocate(n) for n in sizes]
    victim = data.draw(st.sampled_from(live))
    allocator.free(victim)
    before = allocator.free_ranges(), allocator.used_blocks
    with pytest.raises(DoubleFree):
        allocator.free(victim)
    assert (allocator.free_ranges(), allocator.used_blocks) == before
    # The freed blocks go to a new owner; the old handle must not free them.
    successor = allocator.allocate(victim.n_blocks)
    assert successor.start == victim.start
    with pytest.raises(DoubleFree):
        allocator.free(victim)
    allocator.free(successor)


def test_foreign_and_made_up_ranges_raise() -> None:
    mine, theirs = BlockAllocator(8), BlockAllocator(8)
    theirs_range = theirs.allocate(2)
    with pytest.raises(ForeignFree):
        mine.free(theirs_range)  # same start and size, issued by another allocator
    with pytest.raises(ForeignFree):
        mine.free(BlockRange(start=0, n_blocks=2, allocation_id=99, owner_id=theirs_range.owner_id + 1000))
    assert mine.free_ranges() == [(0, 8)]


def test_first_fit_takes_the_lowest_hole_and_merging_joins_both_neighbours() -> None:
    allocator = BlockAllocator(10)
    a, b, c = allocator.allocate(3), allocator.allocate(3), allocator.allocate(3)
    allocator.free(a)
    allocator.free(c)
    assert allocator.free_ranges() == [(0, 3), (6, 4)]
    assert allocator.allocate(2).start == 0  # the first hole that fits, not the largest
    allocator.free(b)  # bridges (3..6) with the free tail: one range remains on that side
    assert allocator.free_ranges() == [(2, 8)]


def test_exhaustion_is_an_answer_not_a_crash() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    assert allocator.try_allocate(2) is None
    with pytest.raises(PoolExhausted):
        allocator.allocate(2)
    with pytest.raises(ValueError):
        allocator.try_allocate(0)


# ---------------------------------------------------------------------------------------------
# Sizing and the pool
# ---------------------------------------------------------------------------------------------


def test_sizing_follows_the_articles_rule() -> None:
    # 512 positions x 20 concurrent requests x 1.2 headroom
    assert pool_tokens_by_rule(512, 20) == 12288
    config = PRESETS["tiny"]
    tokens = pool_tokens_by_fraction(0.001, config, torch.float32, torch.device("cpu"))
    assert tokens > 0


def test_sizes_are_rounded_up_to_whole_blocks() -> None:
    pool = KVMemoryPool(PRESETS["tiny"], capacity_tokens=100, block_tokens=16)
    assert pool.allocator.total_blocks == 7 and pool.capacity_tokens == 112
    assert pool.blocks_for(1) == 1 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    stats = pool.stats()
    assert stats.bytes_total == 112 * PRESETS["tiny"].kv_bytes_per_token(torch.float32)
    assert stats.blocks_used == 0 and stats.free_ranges == 1


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(st.integers(1, 100), min_size=1, max_size=12))
def test_token_requests_become_whole_aligned_blocks_inside_the_pool(requests: list[int]) -> None:
    pool = KVMemoryPool(PRESETS["tiny"], capacity_tokens=512, block_tokens=16)
    row_bytes = pool.storage[0, 0, 0].numel() * pool.storage.element_size()
    for n_tokens in requests:
        try:
            taken = pool.new_cache(1, n_tokens).block_range
        except PoolExhausted:
            continue
        assert taken.n_blocks == -(-n_tokens // 16)  # rounded up, never down
        plane = pool.plane(taken, layer=1, kv=1, n_tokens=n_tokens)
        offset = plane.data_ptr() - pool.storage[1, 1].data_ptr()
        assert offset % (16 * row_bytes) == 0  # starts on a block boundary
        assert offset + n_tokens * row_bytes <= pool.capacity_tokens * row_bytes  # ends inside the pool


def test_a_closed_cache_returns_its_blocks_once() -> None:
    pool = KVMemoryPool(PRESETS["tiny"], capacity_tokens=64, block_tokens=16)
    cache = pool.new_cache(batch_size=2, max_len=20)  # 40 slots -> 3 blocks
    assert pool.stats().blocks_used == 3
    with pytest.raises(PoolExhausted):
        pool.new_cache(batch_size=2, max_len=16)
    cache.close()
    cache.close()  # idempotent: the pool sees one free
    assert pool.stats().blocks_used == 0
    with pytest.raises(RuntimeError):
        cache.update(0, torch.zeros(2, 4, 1, 64), torch.zeros(2, 4, 1, 64))


# ---------------------------------------------------------------------------------------------
# The pooled cache: same tokens, written in place
# ---------------------------------------------------------------------------------------------

PROMPTS = [[10, 20, 30, 40, 50], [7], list(range(60, 90)), [51, 52, 43, 61, 50, 10]]
NEW_TOKENS = [12, 5, 9, 16]


def test_single_sequence_with_the_pool_equals_the_oracle(default_model: LoadedModel, oracle) -> None:
    pool = KVMemoryPool(default_model.config, capacity_tokens=256, block_tokens=16)
    for prompt, new in zip(PROMPTS, NEW_TOKENS):
        with pool.new_cache(1, len(prompt) + new) as cache:
            assert greedy_generate(default_model.model, prompt, new, cache) == oracle(prompt, new)
    assert pool.stats().blocks_used == 0


@pytest.mark.parametrize("prefill", ["by_length", "padded"])
def test_batched_generation_with_the_pool_equals_the_oracle(default_model: LoadedModel, oracle, prefill: str) -> None:
    pool = KVMemoryPool(default_model.config, capacity_tokens=4 * 64, block_tokens=16)
    caches: list[PooledKVCache] = []

    def factory(batch_size: int, max_seq_len: int) -> KVCache:
        caches.append(pool.new_cache(batch_size, max_seq_len))
        return caches[-1]

    outputs = generate_batch(default_model.model, PROMPTS, NEW_TOKENS, PAD_ID, factory, prefill)
    assert [row.output_ids for row in outputs] == [oracle(p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    assert len(caches) == 1
    caches[0].close()
    assert pool.stats().blocks_used == 0


class NewStorageCounter(TorchDispatchMode):
    """Counts tensors produced with storage of their own (not a view of, or written into, an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.new_storages = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        self.new_storages += sum(t.untyped_storage().data_ptr() not in inputs for t in _tensors(out))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


class CountingCache:
    """Wraps any KVCache; counts new storages created inside ``update``, per forward pass."""

    def __init__(self, inner: KVCache) -> None:
        self.inner = inner
        self.per_pass: list[int] = [0]

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with NewStorageCounter() as counter:
            result = self.inner.update(layer, key, value)
        self.per_pass[-1] += counter.new_storages
        return result

    def advance(self, n_tokens: int) -> None:
        self.inner.advance(n_tokens)
        self.per_pass.append(0)


def _count_allocations(default_model: LoadedModel, make_cache) -> list[int]:
    caches: list[CountingCache] = []

    def factory(batch_size: int, max_seq_len: int) -> KVCache:
        caches.append(CountingCache(make_cache(batch_size, max_seq_len)))
        return caches[-1]

    generate_batch(default_model.model, PROMPTS, NEW_TOKENS, PAD_ID, factory)
    (cache,) = caches
    return cache.per_pass[:-1]  # one count per forward pass: prefill first, then each decode step


def test_the_pooled_cache_allocates_no_kv_tensor_while_decoding(default_model: LoadedModel) -> None:
    pool = KVMemoryPool(default_model.config, capacity_tokens=4 * 64, block_tokens=16)
    per_pass = _count_allocations(default_model, pool.new_cache)
    assert len(per_pass) == max(NEW_TOKENS)
    assert per_pass[1:] == [0] * (len(per_pass) - 1)  # the steady decode steps
    assert per_pass[0] == 0  # and not even the prefill: everything lands in the pool


def test_the_counter_catches_the_growing_cache(default_model: LoadedModel) -> None:
    """The same measurement on DynamicKVCache: torch.cat makes new keys and values every step, every layer."""
    n_layer = default_model.config.n_layer
    per_pass = _count_allocations(default_model, lambda batch, length: DynamicKVCache(n_layer))
    assert all(count == 2 * n_layer for count in per_pass[1:])
