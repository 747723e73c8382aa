"""Keys and values in fixed-size blocks of chapter 4's pool, read and written through block tables.

Storage: chapter 4's :class:`~chapters.ch04_memory_pool.memory_pool.KVMemoryPool` tensor,
``(n_layer, 2, capacity_tokens, n_embd)``. Chapter 8 takes the whole pool from chapter 4's range
allocator once (one range, every block: the KV memory still has one ledger) and hands its blocks out
one at a time with its own :class:`~chapters.ch08_continuous_batching.block_manager.BlockManager`.
Token slot ``s`` of the pool is row ``s`` of every (layer, key/value) plane; block ``b`` is slots
``b * block_tokens .. (b + 1) * block_tokens - 1``. Position ``p`` of a sequence with block table
``t`` lives in slot ``t[p // block_tokens] * block_tokens + p % block_tokens``.

A model call computes several sequences at once, each with its own history length. The model wants
what chapter 3 gave it: one left-padded batch. :class:`PagedBatchCache` is that view for one call:

    row 0 (12 cached, 1 new):   [pad pad pad  c0 .. c11 | n0 ]
    row 1 (15 cached, 1 new):   [ c0  ..  c14           | n0 ]

``update`` SCATTERS each row's new keys and values into its own slots, then GATHERS every row's
slots into a fresh ``(B, H, past + T, D)`` tensor (``index_select``), with an attention mask that
hides the padding. That gather is the price of doing paged attention in plain PyTorch: every step
copies every row's whole history once per layer. A fused paged-attention kernel (vLLM's, FlashAttention's
``block_table`` argument, FlashInfer) reads the blocks in place from inside the attention kernel: no
copy, no padding, no mask, and memory traffic of one read of the history instead of a read, a write
and a read again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from chapters.ch04_memory_pool.memory_pool import BlockRange, KVMemoryPool
from chapters.ch08_continuous_batching.block_manager import BlockManager


class PagedKVStore:
    """Chapter 4's pool, cut into blocks that sequences take one by one (a :class:`BlockManager` ledger).

    ``close()`` gives the pool's range back to chapter 4's allocator.
    """

    def __init__(self, pool: KVMemoryPool) -> None:
        self.pool = pool
        self.config = pool.config
        self.block_tokens = pool.block_tokens
        # One range, every block: from now on this store decides who holds which block.
        self._lease: BlockRange | None = pool.allocator.allocate(pool.allocator.total_blocks)
        self.manager = BlockManager(self._lease.n_blocks, pool.block_tokens)
        self._first_slot = self._lease.start * pool.block_tokens  # 0 in practice: the pool was empty

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def plane(self, layer: int, kv: int) -> Tensor:
        """Every token slot of one (layer, key=0/value=1) plane: ``(capacity_tokens, n_embd)``."""
        return self.pool.storage[layer, kv]

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Pool slots of positions ``start .. end - 1`` of ``seq_id`` (its table must cover them)."""
        table, size = self.manager.tables[seq_id], self.block_tokens
        if end > len(table) * size:
            raise ValueError(f"{seq_id!r}: positions up to {end} but blocks for {len(table) * size}")
        first = self._first_slot
        return [first + table[p // size] * size + p % size for p in range(start, end)]

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's keys and values in every layer (copy on write after a fork)."""
        size, first = self.block_tokens, self._first_slot
        src = slice(first + source * size, first + (source + 1) * size)
        dst = slice(first + destination * size, first + (destination + 1) * size)
        self.pool.storage[:, :, dst] = self.pool.storage[:, :, src]

    def close(self) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            self.pool.free(lease)


@dataclass(frozen=True)
class RowSpan:
    """One sequence's part of a model call: ``new_ids`` at positions ``past .. past + len(new_ids) - 1``."""

    seq_id: Hashable
    past: int  # positions already in the cache, before this call
    new_ids: Sequence[int]


class PagedBatchCache:
    """A :class:`shared.model.KVCache` for one model call over several sequences of different lengths.

    Build it with the rows' spans; it also gives the call's left-padded ``input_ids``,
    ``position_ids`` and ``attention_mask`` (None when no row is padded). Every row's block table
    must already cover ``past + len(new_ids)`` positions.
    """

    def __init__(self, store: PagedKVStore, rows: Sequence[RowSpan], pad_id: int) -> None:
        if not rows or any(len(r.new_ids) == 0 for r in rows):
            raise ValueError("a model call needs at least one row, each with at least one new token")
        self.store = store
        device = store.device
        past = max(r.past for r in rows)
        new = max(len(r.new_ids) for r in rows)
        self._past, width = past, past + new
        batch, size = len(rows), store.block_tokens
        for row in rows:  # every row's table must cover what this call writes
            covered = len(store.manager.tables[row.seq_id]) * size
            if row.past + len(row.new_ids) > covered:
                raise ValueError(f"{row.seq_id!r}: positions up to {row.past + len(row.new_ids)} but blocks for {covered}")

        # Column c of row i, right-aligned: history columns [past - past_i, past) hold positions
        # 0 .. past_i - 1, new columns [width - n_i, width) hold positions past_i .. past_i + n_i - 1.
        # Computed for the whole batch at once from the padded block tables (no per-position Python).
        tables = [store.manager.tables[row.seq_id] for row in rows]
        table = torch.zeros((batch, max(len(t) for t in tables)), dtype=torch.long)
        for index, blocks in enumerate(tables):
            table[index, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        row_past = torch.tensor([row.past for row in rows], dtype=torch.long)[:, None]
        row_new = torch.tensor([len(row.new_ids) for row in rows], dtype=torch.long)[:, None]
        column = torch.arange(width)[None, :]
        is_new = column >= width - row_new
        position = torch.where(is_new, column - (width - row_new) + row_past, column - (past - row_past))
        real = is_new | ((column < past) & (position >= 0))
        position = position.clamp(min=0)
        slot = store._first_slot + table.gather(1, (position // size).clamp(max=table.shape[1] - 1)) * size + position % size

        input_ids = torch.full((batch, new), pad_id, dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, new - len(row.new_ids) :] = torch.tensor(list(row.new_ids), dtype=torch.long)
        self.padded = not bool(real.all())
        self.input_ids = input_ids.to(device)
        self.position_ids = torch.where(is_new, position, 0)[:, past:].to(device)  # padding: 0, masked anyway
        self.attention_mask = real.long().to(device) if self.padded else None
        self._gather = torch.where(real, slot, 0).flatten().to(device)  # padding reads slot 0: masked anyway
        self._write_slots = slot[is_new].to(device)  # row by row, each row's new tokens in order
        sources = (torch.arange(batch)[:, None] * new + column - past)[is_new]
        self._write_sources = None if sources.numel() == batch * new else sources.to(device)
        self._shape = (batch, width)

    @property
    def seq_len(self) -> int:
        return self._past

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        batch, heads, new, head_dim = key.shape
        out = []
        for kv, tensor in ((0, key), (1, value)):
            plane = self.store.plane(layer, kv)
            flat = tensor.transpose(1, 2).reshape(batch * new, heads * head_dim)
            if self._write_sources is not None:
                flat = flat.index_select(0, self._write_sources)
            plane.index_copy_(0, self._write_slots, flat.to(plane.dtype))  # scatter: each token into its slot
            if self._past == 0 and self._write_sources is None:
                out.append(tensor)  # nothing cached and nothing padded: the new keys are the whole history
                continue
            gathered = plane.index_select(0, self._gather)  # gather: every row's history, left-padded
            out.append(gathered.view(batch, self._shape[1], heads, head_dim).transpose(1, 2))
        return out[0], out[1]

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        batch, width = self._shape
        heads, head_dim = self.store.config.n_head, self.store.config.head_dim
        return tuple(  # type: ignore[return-value]
            self.store.plane(layer, kv).index_select(0, self._gather).view(batch, width, heads, head_dim).transpose(1, 2)[:, :, : self._past]
            for kv in (0, 1)
        )

    def advance(self, n_tokens: int) -> None:
        pass  # each call builds a fresh view: the sequences' lengths live in the scheduler
