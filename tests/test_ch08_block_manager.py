"""Chapter 8's block manager: property tests (any sequence of operations keeps the ledger consistent) and units."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chapters.ch08_continuous_batching.block_manager import BlockManager, CachedPrefix, OutOfBlocks

TOTAL, SIZE = 12, 4


def assert_consistent(manager: BlockManager) -> None:
    """Raise AssertionError if an invariant of :class:`BlockManager`'s docstring does not hold (every ch08 test's ledger check)."""
    holders = [0] * manager.total_blocks
    for table in manager.tables.values():
        for block in table:
            holders[block] += 1
    for block in range(manager.total_blocks):
        assert holders[block] == manager.ref_counts[block], f"block {block}: count {manager.ref_counts[block]}, held by {holders[block]}"
    assert set(manager._free) == {b for b in range(manager.total_blocks) if holders[b] == 0}, "free queue != unheld blocks"
    assert manager.free_blocks + manager.used_blocks == manager.total_blocks
    # the identity index and the blocks agree, both ways
    for digest, block in manager._block_of_hash.items():
        assert manager._hash_of_block[block] == digest, f"block {block} is indexed under an identity it does not have"
    named = [b for b in range(manager.total_blocks) if manager._hash_of_block[b] is not None]
    assert len(named) == len(manager._block_of_hash), "a block has an identity the index does not list"
    assert manager.prefix_caching or not named, "an identity without prefix caching"
    assert set(manager._chains) == set(manager.tables), "a chain without a table, or a table without a chain"
    for seq_id, chain in manager._chains.items():
        table = manager.tables[seq_id]
        assert len(chain) <= len(table), f"{seq_id!r}: identities beyond its blocks"
        for index, digest in enumerate(chain):
            held = manager._hash_of_block[table[index]]
            assert held is None or held == digest, f"{seq_id!r}: block {table[index]} at {index} holds other tokens than its own"

operations = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 5), st.integers(0, 30)),
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(0, 30)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations)
@pytest.mark.exercise("ch08.1")
def test_any_sequence_of_operations_keeps_free_list_and_reference_counts_consistent(ops) -> None:
    manager = BlockManager(TOTAL, SIZE)
    for op, a, b in ops:
        free_before = manager.free_blocks
        try:
            if op == "allocate":
                if a in manager.tables:
                    continue
                manager.allocate(a, b)
                assert len(manager.tables[a]) == -(-b // SIZE)
            elif op == "grow" and a in manager.tables:
                manager.grow_to(a, b)
                assert len(manager.tables[a]) * SIZE >= b
            elif op == "free" and a in manager.tables:
                manager.free(a)
                assert a not in manager.tables
        except OutOfBlocks:
            assert manager.free_blocks == free_before  # all or nothing
        assert_consistent(manager)
    for seq_id in list(manager.tables):
        manager.free(seq_id)
    assert manager.free_blocks == TOTAL and all(count == 0 for count in manager.ref_counts)


@pytest.mark.exercise("ch08.1")
def test_a_shared_block_returns_to_the_free_list_only_when_its_last_holder_frees_it() -> None:
    manager = BlockManager(4, 2)
    manager.allocate("first", 3)  # 2 blocks
    shared = CachedPrefix(blocks=(0,), hashes=(b"0",), queried_tokens=3, block_tokens=2)  # as prefix caching finds it
    manager.allocate("second", 3, shared)  # first's first block, shared, and one of its own
    assert manager.free("first") == 1 and "first" not in manager.tables, "the shared block stays"
    assert manager.free_blocks == 2
    assert manager.free("second") == 2
    assert manager.free_blocks == 4


@pytest.mark.exercise("ch08.1")
def test_allocation_is_all_or_nothing_when_short() -> None:
    manager = BlockManager(3, 4)
    manager.allocate("a", 8)
    with pytest.raises(OutOfBlocks):
        manager.allocate("b", 8)
    assert "b" not in manager.tables and manager.free_blocks == 1
    with pytest.raises(OutOfBlocks):
        manager.grow_to("a", 16)
    assert len(manager.tables["a"]) == 2
    assert_consistent(manager)


# -- prefix caching: the same ledger, plus blocks found by their tokens ----------------------------

PREFIXES = ([1, 2, 3, 4] * 4, [1, 2, 3, 4, 5, 6, 7, 8] * 2, [2, 1] * 8)  # equal blocks at different places


class CachingModel:
    """What the pool would physically hold: for each written slot, the prefix its keys and values were computed from.

    A slot's keys and values depend on every token up to its position, so a cached block is right
    for a query only if each of its slots was computed from exactly the query's prefix up to there.
    """

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.slots: dict[int, dict[int, tuple[int, ...]]] = {b: {} for b in range(manager.total_blocks)}

    def assert_holds(self, blocks: tuple[int, ...] | list[int], query: list[int]) -> None:
        for index, block in enumerate(blocks):
            for offset in range(SIZE):
                position = index * SIZE + offset
                assert self.slots[block].get(offset) == tuple(query[: position + 1]), (
                    f"block {block} at {index} was computed from other tokens than the query's")

    def compute(self, seq: int, n: int) -> None:
        """Compute ``n`` more positions of ``seq`` (a decode appends a token first), as a step would, then register."""
        manager, tokens = self.manager, self.tokens[seq]
        if self.computed[seq] == len(tokens):
            tokens.append((len(tokens) + seq) % 3)  # a decoded token; few values make equal blocks likely
        end = min(self.computed[seq] + n, len(tokens))
        manager.grow_to(seq, end)
        for position in range(self.computed[seq], end):
            table = manager.tables[seq]
            block = table[position // SIZE]
            assert manager.ref_counts[block] == 1, f"{seq} writes position {position} into a shared block"
            self.slots[block][position % SIZE] = tuple(tokens[: position + 1])
            self.computed[seq] = position + 1
        manager.cache_full_blocks(seq, tokens, self.computed[seq])


class PrefixCachingMachine(RuleBasedStateMachine):
    """Any interleaving of admit-with-prefix / compute (grow, write, register) / free / lookup.

    After every rule: the ledger is consistent (:func:`assert_consistent`), and every
    cached lookup returned blocks computed from exactly the query's tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(TOTAL, SIZE, prefix_caching=True)
        self.model = CachingModel(self.manager)

    def snapshot(self) -> tuple:
        m = self.manager
        return dict(m._free), list(m.ref_counts), {s: list(t) for s, t in m.tables.items()}

    @rule(seq=st.integers(0, 4), which=st.integers(0, len(PREFIXES) - 1), keep=st.integers(0, 16), suffix=st.integers(1, 6),
          extra=st.integers(0, 12))
    def admit(self, seq: int, which: int, keep: int, suffix: int, extra: int) -> None:
        manager = self.manager
        if seq in manager.tables:
            return
        query = PREFIXES[which][:keep] + [9] * suffix
        cached = manager.cached_prefix(query)
        self.model.assert_holds(cached.blocks, query)
        assert cached.tokens <= len(query) - 1, "the last token is always left to compute"
        before = self.snapshot()
        try:
            manager.allocate(seq, cached.tokens + 1 + extra, cached)
        except OutOfBlocks:
            assert self.snapshot() == before, "all or nothing"
            return
        table = manager.tables[seq]
        assert table[: len(cached.blocks)] == list(cached.blocks)
        for block in table[len(cached.blocks):]:
            assert before[1][block] == 0 and manager.ref_counts[block] == 1, "a new block was free and is now private"
        for block in cached.blocks:
            assert manager.ref_counts[block] == before[1][block] + 1, "a hit is one more holder"
        self.model.tokens[seq], self.model.computed[seq] = query, cached.tokens

    @precondition(lambda self: self.manager.tables)
    @rule(data=st.data(), n=st.integers(1, 9))
    def compute(self, data: st.DataObject, n: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.manager.tables)))
        before = self.snapshot()
        try:
            self.model.compute(seq, n)
        except OutOfBlocks:
            assert self.snapshot()[:2] == before[:2], "all or nothing"

    @precondition(lambda self: self.manager.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        manager = self.manager
        seq = data.draw(st.sampled_from(sorted(manager.tables)))
        held_elsewhere = {block for s, t in manager.tables.items() if s != seq for block in t}
        manager.free(seq)
        assert all(manager.ref_counts[block] > 0 for block in held_elsewhere), "a block another table holds was released"
        del self.model.tokens[seq], self.model.computed[seq]

    @rule(which=st.integers(0, len(PREFIXES) - 1), keep=st.integers(0, 16))
    def lookup(self, which: int, keep: int) -> None:
        query = PREFIXES[which][:keep] + [9]
        self.model.assert_holds(self.manager.cached_prefix(query).blocks, query)

    @invariant()
    def consistent(self) -> None:
        assert_consistent(self.manager)
        assert self.manager.hits_tokens <= self.manager.lookups_tokens

    def teardown(self) -> None:
        manager = self.manager
        for seq_id in list(manager.tables):
            manager.free(seq_id)
        assert_consistent(manager)
        assert manager.free_blocks == TOTAL and all(count == 0 for count in manager.ref_counts)
        for which in range(len(PREFIXES)):  # what is still cached after everybody left is still right
            query = PREFIXES[which] + [9]
            self.model.assert_holds(manager.cached_prefix(query).blocks, query)


PrefixCachingMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_with_prefix_caching_no_block_is_freed_while_held_and_no_lookup_returns_other_tokens = PrefixCachingMachine.TestCase
