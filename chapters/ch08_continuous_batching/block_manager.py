"""The bookkeeping of a paged KV cache: fixed-size blocks, a block table per sequence, reference counts.

Chapter 4 handed each BATCH one contiguous range of the pool, sized for its longest row. Here every
SEQUENCE gets blocks one at a time, from anywhere in the pool: its block table lists them in order,
so position ``p`` of the sequence lives in block ``table[p // block_tokens]`` at offset
``p % block_tokens``. No range has to be contiguous, so nothing fragments and nothing is reserved
for tokens that may never come (vLLM's PagedAttention, the operating system's page table).

A block may belong to several sequences at once (``fork``: a child starts with its parent's
blocks, as beam search or a shared prompt prefix would). Its reference count says how many tables
hold it; it returns to the free list when the last one lets go. A shared block must be copied before
either owner writes into it (copy on write): :meth:`BlockManager.make_last_block_writable` says
which block to copy where.

Pure bookkeeping, no tensors: :mod:`~chapters.ch08_continuous_batching.paged_cache` stores the keys
and values. All calls come from the engine's one thread; ``/stats`` only reads integers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable


class OutOfBlocks(Exception):
    """Not enough free blocks right now; the scheduler waits, or preempts, and never crashes."""


class BlockManager:
    """Blocks ``0 .. total_blocks - 1`` of ``block_tokens`` token slots each, handed out one by one.

    Invariants (the property tests check them after every operation):

    - every block is either in the free list (reference count 0) or in at least one block table,
      and its reference count equals the number of tables that hold it;
    - the free list holds no block twice; ``free_blocks + used_blocks == total_blocks``;
    - a table holds exactly ``ceil(tokens / block_tokens)`` blocks for the tokens it was sized for.
    """

    def __init__(self, total_blocks: int, block_tokens: int) -> None:
        if total_blocks < 1 or block_tokens < 1:
            raise ValueError(f"need at least one block of at least one token, got {total_blocks} x {block_tokens}")
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        # FIFO free list: a freed block goes to the back, so recently used blocks are reused last
        # (a bug that reads a freed block shows up as wrong tokens sooner, not never).
        self._free: deque[int] = deque(range(total_blocks))
        self.ref_counts: list[int] = [0] * total_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}  # token slots each table is sized for

    # -- figures ------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` token slots."""
        return math.ceil(n_tokens / self.block_tokens)

    def tokens_of(self, seq_id: Hashable) -> int:
        return self._tokens[seq_id]

    def blocks_needed(self, seq_id: Hashable, n_tokens: int) -> int:
        """New blocks :meth:`grow_to` would take to hold ``n_tokens`` (0 for an unknown sequence: all of them)."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, self.blocks_for(n_tokens) - have)

    def can_grow_to(self, seq_id: Hashable, n_tokens: int) -> bool:
        return self.blocks_needed(seq_id, n_tokens) <= len(self._free)

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, n_tokens: int) -> list[int]:
        """A new table for ``seq_id`` with room for ``n_tokens`` slots; raise :class:`OutOfBlocks` (taking nothing) if short."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        self.tables[seq_id] = []
        self._tokens[seq_id] = 0
        try:
            return self.grow_to(seq_id, n_tokens)
        except OutOfBlocks:
            del self.tables[seq_id], self._tokens[seq_id]
            raise

    def grow_to(self, seq_id: Hashable, n_tokens: int) -> list[int]:
        """Make ``seq_id``'s table hold at least ``n_tokens`` slots; all or nothing. Returns the table."""
        # EXERCISE ch08.1 BEGIN "paged allocation: take whole blocks from the free list, all or nothing"
        table = self.tables[seq_id]
        needed = self.blocks_for(n_tokens) - len(table)
        if needed > len(self._free):
            raise OutOfBlocks(f"{seq_id!r} needs {needed} more blocks; {len(self._free)} are free")
        for _ in range(max(0, needed)):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            table.append(block)
        self._tokens[seq_id] = max(self._tokens[seq_id], n_tokens)
        return table
        # EXERCISE ch08.1 END

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[int]:
        """A table for ``child_id`` that shares every block of ``parent_id`` (each block's count goes up by one)."""
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = list(self.tables[parent_id])
        for block in table:
            self.ref_counts[block] += 1
        self.tables[child_id] = table
        self._tokens[child_id] = self._tokens[parent_id]
        return table

    def make_last_block_writable(self, seq_id: Hashable) -> tuple[int, int] | None:
        """Copy on write: if ``seq_id``'s last block is shared, give it a private one.

        Returns ``(source, destination)`` blocks whose contents the caller must copy, or None when
        the last block was already private. Raises :class:`OutOfBlocks` when no block is free.
        """
        table = self.tables[seq_id]
        if not table or self.ref_counts[table[-1]] == 1:
            return None
        if not self._free:
            raise OutOfBlocks(f"{seq_id!r} must copy a shared block and none is free")
        shared, private = table[-1], self._free.popleft()
        self.ref_counts[shared] -= 1
        self.ref_counts[private] = 1
        table[-1] = private
        return shared, private

    # -- release ------------------------------------------------------------------------------

    def free(self, seq_id: Hashable) -> int:
        """Drop ``seq_id``'s table; blocks nobody else holds go back to the free list. Returns how many did."""
        # EXERCISE ch08.1 BEGIN "paged allocation: take whole blocks from the free list, all or nothing"
        table = self.tables.pop(seq_id)
        del self._tokens[seq_id]
        released = 0
        for block in reversed(table):  # the tail first: it is the least likely to be shared
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free.append(block)
                released += 1
        return released
        # EXERCISE ch08.1 END

    # -- checks -------------------------------------------------------------------------------

    def check_consistent(self) -> None:
        """Raise AssertionError if an invariant of the class docstring does not hold (tests call it)."""
        holders = [0] * self.total_blocks
        for seq_id, table in self.tables.items():
            assert len(table) == self.blocks_for(self._tokens[seq_id]), f"{seq_id!r}: {len(table)} blocks for {self._tokens[seq_id]} tokens"
            for block in table:
                holders[block] += 1
        assert len(set(self._free)) == len(self._free), "a block is twice in the free list"
        for block in range(self.total_blocks):
            assert holders[block] == self.ref_counts[block], f"block {block}: count {self.ref_counts[block]}, held by {holders[block]}"
        assert set(self._free) == {b for b in range(self.total_blocks) if holders[b] == 0}, "free list != unheld blocks"
