"""Keys and values in fixed-size blocks of chapter 4's pool, written and read through block tables; nothing here computes.

In the pool ``(n_layer, 2, capacity_tokens, kv_width)``, position ``p`` of a sequence with block table ``t`` lives in token slot
``t[p // block_tokens] * block_tokens + p % block_tokens`` of every (layer, key/value) plane (:meth:`PagedKVStore.slots`)."""

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
    """The pool's dtype for setting ``name`` (auto, fp32, bf16; :data:`KV_CACHE_RULE`), for an engine computing in
    ``activation_dtype`` whose products are bf16 or not (chapter 5's ``multiplies_in_bf16``); ValueError for another name."""
    if name == "fp32":
        return torch.float32
    if name == "bf16":
        return torch.bfloat16
    if name != "auto":
        raise ValueError(f"unknown KV cache dtype {name!r}; choose auto, fp32 or bf16")
    return torch.bfloat16 if bf16_products else activation_dtype


class PagedKVStore:
    """Chapter 4's pool taken whole as one range of its allocator, for as long as the pool lives, and handed out block by
    block through a :class:`BlockManager` (``prefix_caching``: its computed full blocks stay findable by their tokens)."""

    def __init__(self, pool: KVMemoryPool, prefix_caching: bool = False) -> None:
        self.pool = pool
        self.config = pool.config
        self.block_tokens = pool.block_tokens
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
        """Every token slot of one (layer, key=0/value=1) plane: ``(capacity_tokens, kv_width)``, a token's heads side by side."""
        return self.pool.storage[layer, kv]

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Pool slots of positions ``start .. end - 1`` of ``seq_id`` (its table must cover them)."""
        table, size = self.manager.tables[seq_id], self.block_tokens
        if end > len(table) * size:
            raise ValueError(f"{seq_id!r}: positions up to {end} but blocks for {len(table) * size}")
        # EXERCISE ch08.5 BEGIN "the slot mapping: the pool slot of each position, through the block table"
        first = self._first_slot
        return [first + table[p // size] * size + p % size for p in range(start, end)]
