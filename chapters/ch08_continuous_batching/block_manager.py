"""The bookkeeping of a paged KV cache: fixed-size blocks, a block table per sequence, reference counts.

Chapter 4 handed each BATCH one contiguous range of the pool, sized for its longest row. Here every
SEQUENCE gets blocks one at a time, from anywhere in the pool: its block table lists them in order,
so position ``p`` of the sequence lives in block ``table[p // block_tokens]`` at offset
``p % block_tokens``. No range has to be contiguous, so nothing fragments and nothing is reserved
for tokens that may never come (vLLM's PagedAttention, the operating system's page table).

A block may belong to several sequences at once, through **prefix caching** (``prefix_caching=True``;
vLLM's automatic prefix caching, nano-vllm's block manager): a FULL block whose keys and values are
computed gets an identity, :func:`block_hash` of its tokens chained with its parent block's
identity, so equal identities mean equal tokens at equal positions after an equal prefix. A new
sequence starts with every cached block of its prompt's prefix (:meth:`BlockManager.cached_prefix`,
then :meth:`BlockManager.allocate`) and computes only the rest. A block's reference count says how
many tables hold it; it returns to the free queue when the last one lets go. A block nobody holds
keeps its identity in the free queue, least recently released first, and stays findable until it
is handed out for other tokens: caching costs no memory, it only delays forgetting. A shared block
is never written: only full blocks are shared, and every sequence computes at least its last token
itself, in a block of its own (so no copy on write is needed).

Pure bookkeeping, no tensors: :mod:`~chapters.ch08_continuous_batching.paged_cache` stores the keys
and values. All calls come from the engine's one thread; ``/stats`` only reads integers.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

ROOT_HASH = b""  # the "parent" of a sequence's first block


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The identity of one full block: SHA-256 over its parent block's identity and its token ids.

    ``parent`` is :data:`ROOT_HASH` for a sequence's first block. Two blocks get the same identity
    only when they hold the same tokens after the same prefix, so the cache may hand one out for
    the other. A cryptographic hash, never Python's ``hash()``: a collision would give a sequence
    another prompt's keys and values, silently. Each token id is encoded at a fixed width, so no
    two different token lists give the same bytes.
    """
    # EXERCISE ch08.6 BEGIN "the block hash chain: a full block's identity from its parent's and its tokens"
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()
    # EXERCISE ch08.6 END


class OutOfBlocks(Exception):
    """Not enough free blocks right now; the scheduler waits, or preempts, and never crashes."""


@dataclass(frozen=True)
class CachedPrefix:
    """What :meth:`BlockManager.cached_prefix` found: the leading blocks whose keys and values are already computed.

    ``blocks[i]`` holds tokens ``i * block_tokens .. (i + 1) * block_tokens - 1`` of the query and
    its identity is ``hashes[i]``; ``queried_tokens`` is the query's length (for the hit rate; 0
    when the manager does not cache, and so looked nothing up). ``missing`` is the identity of the
    first full block it did not find (None: every full block before the last token was found, or
    no caching): what that block will be called once some sequence has computed it.
    """

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
    """Blocks ``0 .. total_blocks - 1`` of ``block_tokens`` token slots each, handed out one by one.

    Invariants (the property tests check them after every operation: ``tests/test_ch08_block_manager.py``):

    - every block is either in the free queue (reference count 0) or in at least one block table,
      and its reference count equals the number of tables that hold it;
    - the free queue holds each free block once; ``free_blocks + used_blocks == total_blocks``;
    - a table holds ``ceil(n / block_tokens)`` blocks for the most tokens ``n`` it was asked to hold (it never shrinks);
    - with prefix caching: a block has at most one identity and an identity at most one block (the
      index and the blocks agree); a table's block that has an identity has the one its sequence's
      tokens give at that place; without it, no block has an identity.
    """

    def __init__(self, total_blocks: int, block_tokens: int, prefix_caching: bool = False) -> None:
        if total_blocks < 1 or block_tokens < 1:
            raise ValueError(f"need at least one block of at least one token, got {total_blocks} x {block_tokens}")
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        # The free queue, least recently released first: a block handed out comes from the front, a
        # released one goes to the back. So a cached block is forgotten as late as possible, and a
        # bug that reads a freed block shows up as wrong tokens sooner, not never. An ordered dict
        # (keys only) so that a cache hit can take a block out of the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(total_blocks))
        self.ref_counts: list[int] = [0] * total_blocks
        self.tables: dict[Hashable, list[int]] = {}
        # Prefix caching: each block's identity (None: none), the index from identity to block, and
        # each sequence's chain (the identities its tokens give its leading computed full blocks,
        # registered or not: the next block's parent is the last of them).
        self._hash_of_block: list[bytes | None] = [None] * total_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self._chains: dict[Hashable, list[bytes]] = {}
        self.lookups_tokens = 0  # tokens of the sequences that asked the cache when they were allocated
        self.hits_tokens = 0  # of those, tokens found computed
        self.evictions = 0  # cached blocks handed out for other tokens

    # -- figures ------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds (cached ones included: they are free memory)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks that have an identity (held or free)."""
        return len(self._block_of_hash)

    def identified_blocks(self) -> list[int]:
        """The blocks that have an identity (prefix caching), held or free: the live page marks them."""
        return list(self._block_of_hash.values())

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` token slots."""
        return math.ceil(n_tokens / self.block_tokens)

    def can_grow_to(self, seq_id: Hashable, n_tokens: int) -> bool:
        """Whether :meth:`grow_to` would find the blocks ``seq_id`` lacks for ``n_tokens`` free."""
        return self.blocks_for(n_tokens) - len(self.tables[seq_id]) <= len(self._free)

    def describe_prefix_cache(self) -> dict:
        """The prefix cache's figures for ``/stats``."""
        return {
            "enabled": self.prefix_caching,
            "lookups_tokens": self.lookups_tokens,
            "hits_tokens": self.hits_tokens,
            "hit_rate": round(self.hits_tokens / self.lookups_tokens, 4) if self.lookups_tokens else None,
            "cached_blocks": self.cached_blocks,
            "evictions": self.evictions,
        }

    # -- prefix caching -----------------------------------------------------------------------

    def cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The cached blocks that hold the longest prefix of ``token_ids`` (nothing without prefix caching).

        Only full blocks lying wholly within ``token_ids[:-1]``: the last token is always computed
        (its logits give the next token), so a sequence never writes into a block it shares. Reads
        only; :meth:`allocate` takes the blocks.
        """
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
        """Give an identity to each full block of ``seq_id`` whose keys and values are now computed.

        ``token_ids`` are the sequence's tokens, ``num_computed`` how many leading positions the
        cache holds. Call it after every step (a prompt chunk or a decoded token may fill a block);
        a block is never registered before its last position is computed. When another block
        already has the identity (two equal prompts computed side by side) the first keeps it and
        this one stays anonymous. Returns how many blocks were registered.
        """
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

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, n_tokens: int, prefix: CachedPrefix | None = None) -> list[int]:
        """A new table for ``seq_id`` with room for ``n_tokens`` slots; raise :class:`OutOfBlocks` (taking nothing) if short.

        With ``prefix`` (what :meth:`cached_prefix` just returned for this sequence's tokens) the
        table starts with those blocks, shared: a held one's count goes up by one, a free one
        leaves the free queue. The caller then computes from position ``prefix.tokens``.
        """
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
        # EXERCISE ch08.1 END

    # -- release ------------------------------------------------------------------------------

    def free(self, seq_id: Hashable) -> int:
        """Drop ``seq_id``'s table; blocks nobody else holds go to the back of the free queue. Returns how many did.

        A released block keeps its identity: a later sequence with the same prefix still finds it,
        until the free queue hands it out for other tokens.
        """
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
        # EXERCISE ch08.1 END
