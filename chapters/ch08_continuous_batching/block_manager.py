"""The bookkeeping of a paged KV cache: fixed-size blocks, a block table per sequence, reference counts, prefix caching.

Position ``p`` of a sequence lives in block ``table[p // block_tokens]`` at offset ``p % block_tokens``; with prefix caching a
computed full block is shared through its identity (:func:`block_hash`). No tensors; every call comes from the engine's thread."""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

ROOT_HASH = b""  # the "parent" of a sequence's first block


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A full block's identity: SHA-256 of its parent's identity (:data:`ROOT_HASH` for a first block) and its token ids at a
    fixed width, so equal identities mean equal tokens after an equal prefix (a collision would serve another prompt's keys)."""
    # EXERCISE ch08.6 BEGIN "the block hash chain: a full block's identity from its parent's and its tokens"
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class OutOfBlocks(Exception):
    """Not enough free blocks right now; the scheduler waits, or preempts, and never crashes."""


@dataclass(frozen=True)
class CachedPrefix:
    """What :meth:`BlockManager.cached_prefix` found: ``blocks[i]`` (identity ``hashes[i]``) holds the query's ``i``-th block,
    computed; ``queried_tokens``: the query's length (0 without caching); ``missing``: the first identity not found, or None."""

    blocks: tuple[int, ...]
    hashes: tuple[bytes, ...]
    queried_tokens: int
    block_tokens: int
    missing: bytes | None = None

    @property
    def tokens(self) -> int:
        """Leading positions that need no computing."""
        return len(self.blocks) * self.block_tokens


class BlockManager:
    """Blocks ``0 .. total_blocks - 1`` of ``block_tokens`` token slots each; a released block keeps its identity until the
    free queue, least recently released first, hands it out for other tokens. Invariants (``tests/test_ch08_block_manager.py``):
    - a block's reference count is the number of tables that hold it, and it is in the free queue exactly when that is 0;
    - the free queue holds each free block once; ``free_blocks + used_blocks == total_blocks``;
    - a table holds ``ceil(n / block_tokens)`` blocks for the most tokens ``n`` it was asked to hold (it never shrinks);
    - with prefix caching a block has at most one identity and an identity at most one block, and a table's block that has
      one has the one its sequence's tokens give at that place; without it, no block has an identity."""

    def __init__(self, total_blocks: int, block_tokens: int, prefix_caching: bool = False) -> None:
        if total_blocks < 1 or block_tokens < 1:
            raise ValueError(f"need at least one block of at least one token, got {total_blocks} x {block_tokens}")
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(total_blocks))  # a dict: a hit leaves it in O(1)
        self.ref_counts: list[int] = [0] * total_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self._hash_of_block: list[bytes | None] = [None] * total_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self._chains: dict[Hashable, list[bytes]] = {}  # each sequence's computed full blocks' identities, in order
        self.lookups_tokens = 0  # tokens of the sequences that asked the cache when they were allocated
        self.hits_tokens = 0  # of those, tokens found computed
        self.evictions = 0  # cached blocks handed out for other tokens

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds (cached ones included: they are free memory)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def identified_blocks(self) -> list[int]:
        """The blocks that have an identity (prefix caching), held or free: the live page marks them."""
        return list(self._block_of_hash.values())

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_tokens)

    def can_grow_to(self, seq_id: Hashable, n_tokens: int) -> bool:
        """Whether :meth:`grow_to` would find the blocks ``seq_id`` lacks for ``n_tokens`` free."""
        return self.blocks_for(n_tokens) - len(self.tables[seq_id]) <= len(self._free)

    def describe_prefix_cache(self) -> dict:
        return {
            "enabled": self.prefix_caching,
            "lookups_tokens": self.lookups_tokens,
            "hits_tokens": self.hits_tokens,
            "hit_rate": round(self.hits_tokens / self.lookups_tokens, 4) if self.lookups_tokens else None,
            "cached_blocks": self.cached_blocks,
            "evictions": self.evictions,
        }

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The cached blocks holding the longest prefix of ``token_ids`` (none without prefix caching); reads only. Only
        full blocks within ``token_ids[:-1]``: the last token is always computed, so a shared block is never written."""
        blocks: list[int] = []
        hashes: list[bytes] = []
        missing = None
        if self.prefix_caching:
            size, parent = self.block_tokens, ROOT_HASH
            for index in range((len(token_ids) - 1) // size):
                digest = block_hash(parent, token_ids[index * size : (index + 1) * size])
                block = self._block_of_hash.get(digest)
                if block is None:
                    missing = digest
                    break  # a chain: no later block can match without this one
                blocks.append(block)
                hashes.append(digest)
                parent = digest
        return CachedPrefix(tuple(blocks), tuple(hashes), len(token_ids) if self.prefix_caching else 0, self.block_tokens, missing)

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> int:
        """Give an identity to each full block of ``seq_id`` within its ``num_computed`` leading positions; call it after every
        step. Returns how many were registered. When another block has the identity already, that one keeps it."""
        if not self.prefix_caching:
            return 0
        table, chain, size = self.tables[seq_id], self._chains[seq_id], self.block_tokens
        full = min(num_computed, len(token_ids), len(table) * size) // size
        registered = 0
        for index in range(len(chain), full):
            digest = block_hash(chain[-1] if chain else ROOT_HASH, token_ids[index * size : (index + 1) * size])
            chain.append(digest)
            block = table[index]
            if digest not in self._block_of_hash and self._hash_of_block[block] is None:
                self._block_of_hash[digest] = block
                self._hash_of_block[block] = digest
                registered += 1
        return registered

    def _pop_free(self) -> int:
        """The least recently released free block, its identity forgotten (it is about to hold other tokens)."""
        block, _ = self._free.popitem(last=False)
        digest = self._hash_of_block[block]
        if digest is not None:
            del self._block_of_hash[digest]
            self._hash_of_block[block] = None
            self.evictions += 1
        return block

    def allocate(self, seq_id: Hashable, n_tokens: int, prefix: CachedPrefix | None = None) -> list[int]:
        """A new table for ``seq_id`` with room for ``n_tokens`` slots, :class:`OutOfBlocks` (taking nothing) if short. With
        ``prefix`` (:meth:`cached_prefix`'s answer) it starts with those blocks, shared; compute from ``prefix.tokens`` on."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        hits, hashes = (prefix.blocks, prefix.hashes) if prefix is not None else ((), ())
        reviving = sum(1 for block in hits if self.ref_counts[block] == 0)  # cached, but in the free queue
        needed = max(0, self.blocks_for(n_tokens) - len(hits))
        if reviving + needed > len(self._free):
            raise OutOfBlocks(f"{seq_id!r} needs {reviving} cached and {needed} new blocks; {len(self._free)} are free")
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        self.tables[seq_id] = list(hits)
        self._chains[seq_id] = list(hashes)
        if prefix is not None:
            self.lookups_tokens += prefix.queried_tokens
            self.hits_tokens += prefix.tokens
        return self.grow_to(seq_id, n_tokens)  # the blocks are there: checked above

    def grow_to(self, seq_id: Hashable, n_tokens: int) -> list[int]:
        """Make ``seq_id``'s table hold at least ``n_tokens`` slots; all or nothing. Returns the table."""
        # EXERCISE ch08.1 BEGIN "paged allocation: take whole blocks from the free list, all or nothing"
        table = self.tables[seq_id]
        needed = self.blocks_for(n_tokens) - len(table)
        if needed > len(self._free):
            raise OutOfBlocks(f"{seq_id!r} needs {needed} more blocks; {len(self._free)} are free")
        for _ in range(max(0, needed)):
            block = self._pop_free()
            self.ref_counts[block] = 1
            table.append(block)
        return table

    def free(self, seq_id: Hashable) -> int:
        """Drop ``seq_id``'s table; returns how many of its blocks nobody else holds, now at the back of the free queue."""
        self._chains.pop(seq_id, None)
        # EXERCISE ch08.1 BEGIN "paged allocation: take whole blocks from the free list, all or nothing"
        table = self.tables.pop(seq_id)
        released = 0
        for block in reversed(table):  # the tail first: the least likely to be shared, and forgotten first
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None  # to the back of the queue
                released += 1
        return released
