"""Keys and values in fixed-size blocks of chapter 4's pool, written and read through block tables.

Storage: chapter 4's :class:`~chapters.ch04_memory_pool.memory_pool.KVMemoryPool` tensor,
``(n_layer, 2, capacity_tokens, kv_width)``: a token's key (and value) heads side by side,
``config.kv_width`` numbers (the key/value heads, fewer than the query heads under grouped-query
attention, times the head width). Chapter 8 takes the whole pool from chapter 4's range allocator
once (one range, every block: the KV memory still has one ledger) and hands its blocks out one at a
time with its own :class:`~chapters.ch08_continuous_batching.block_manager.BlockManager`.
Token slot ``s`` of the pool is row ``s`` of every (layer, key/value) plane; block ``b`` is slots
``b * block_tokens .. (b + 1) * block_tokens - 1``. Position ``p`` of a sequence with block table
``t`` lives in slot ``t[p // block_tokens] * block_tokens + p % block_tokens`` (:meth:`PagedKVStore.slots`,
the SLOT MAPPING of a step's new tokens).

Nothing here computes: a step writes its new keys and values along the slot mapping and attention
reads them back through the block tables (:mod:`~chapters.ch08_continuous_batching.paged_attention`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

import torch
from torch import Tensor

from chapters.ch04_memory_pool.memory_pool import BlockRange, KVMemoryPool
from chapters.ch08_continuous_batching.block_manager import BlockManager
from shared.unwritten import or_meanwhile


KV_CACHE_DTYPES = Literal["auto", "fp32", "bf16"]
KV_CACHE_RULE = (
    "auto: bf16 when the engine multiplies in bf16 (its products already round keys and values to bf16 "
    "precision), else the engine's activation dtype"
)


def kv_cache_dtype(name: str, bf16_products: bool, activation_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the pool's keys and values for an engine computing in ``activation_dtype``, which
    multiplies in bf16 or not (``bf16_products``: chapter 5's :func:`~chapters.ch05_inference_engine.engine.multiplies_in_bf16`).

    A decode step reads every cached key and value of every running sequence once per layer and
    does little arithmetic with each: attention is bound by the bytes it reads, so a 2-byte cache
    halves its time. Chapter 5's bf16 engine on a CPU keeps activations in fp32
    (:mod:`~chapters.ch05_inference_engine.bf16_matmul`), but the keys and values come out of bf16
    products, so storing them in bf16 (as vLLM's CPU backend does under a bf16 model) loses little
    more; its accuracy is measured in the tests against fp32's. An engine that multiplies in fp32
    (fp32, or a bf16 engine on a CPU where bf16 lost at every size) keeps an fp32 cache and stays
    token-exact. See :data:`KV_CACHE_RULE`.
    """
    if name == "fp32":
        return torch.float32
    if name == "bf16":
        return torch.bfloat16
    if name != "auto":
        raise ValueError(f"unknown KV cache dtype {name!r}; choose auto, fp32 or bf16")
    return torch.bfloat16 if bf16_products else activation_dtype


class PagedKVStore:
    """Chapter 4's pool, cut into blocks that sequences take one by one (a :class:`BlockManager` ledger).

    ``prefix_caching``: the ledger keeps computed full blocks findable by their tokens (see
    :mod:`~chapters.ch08_continuous_batching.block_manager`). The store holds the pool's one range
    for as long as the pool lives (a model version's backend owns both).
    """

    def __init__(self, pool: KVMemoryPool, prefix_caching: bool = False) -> None:
        self.pool = pool
        self.config = pool.config
        self.block_tokens = pool.block_tokens
        # One range, every block: from now on this store decides who holds which block.
        lease: BlockRange | None = or_meanwhile(
            lambda: pool.allocator.allocate(pool.allocator.total_blocks), lambda: None,
            "the paged store uses the pool without recording it in chapter 4's ledger")
        n_blocks = lease.n_blocks if lease is not None else pool.allocator.total_blocks
        self.manager = BlockManager(n_blocks, pool.block_tokens, prefix_caching=prefix_caching)
        self.first_block = lease.start if lease is not None else 0  # 0 in practice: the pool was empty
        self._first_slot = self.first_block * pool.block_tokens

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def plane(self, layer: int, kv: int) -> Tensor:
        """Every token slot of one (layer, key=0/value=1) plane: ``(capacity_tokens, kv_width)``, a token's
        key/value heads side by side."""
        return self.pool.storage[layer, kv]

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Pool slots of positions ``start .. end - 1`` of ``seq_id`` (its table must cover them)."""
        table, size = self.manager.tables[seq_id], self.block_tokens
        if end > len(table) * size:
            raise ValueError(f"{seq_id!r}: positions up to {end} but blocks for {len(table) * size}")
        # EXERCISE ch08.5 BEGIN "the slot mapping: the pool slot of each position, through the block table"
        first = self._first_slot
        return [first + table[p // size] * size + p % size for p in range(start, end)]
        # EXERCISE ch08.5 END
