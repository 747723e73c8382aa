"""Chapter 8's block manager: property tests (any sequence of operations keeps the ledger consistent) and units."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chapters.ch08_continuous_batching.block_manager import BlockManager, OutOfBlocks

TOTAL, SIZE = 12, 4

operations = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 5), st.integers(0, 30)),
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(0, 30)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.integers(0, 5)),
        st.tuples(st.just("write_last"), st.integers(0, 5), st.just(0)),
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
            elif op == "fork" and a in manager.tables and b not in manager.tables:
                manager.fork(a, b)
                assert manager.tables[a] == manager.tables[b]
                assert manager.free_blocks == free_before  # sharing takes no block
            elif op == "write_last" and a in manager.tables:
                copy = manager.make_last_block_writable(a)
                if manager.tables[a]:
                    assert manager.ref_counts[manager.tables[a][-1]] == 1
                if copy is not None:
                    assert copy[0] != copy[1]
            elif op == "free" and a in manager.tables:
                manager.free(a)
                assert a not in manager.tables
        except OutOfBlocks:
            assert manager.free_blocks == free_before  # all or nothing
        manager.check_consistent()
    for seq_id in list(manager.tables):
        manager.free(seq_id)
    assert manager.free_blocks == TOTAL and all(count == 0 for count in manager.ref_counts)


@pytest.mark.exercise("ch08.1")
def test_a_shared_block_returns_to_the_free_list_only_when_its_last_holder_frees_it() -> None:
    manager = BlockManager(4, 2)
    manager.allocate("parent", 3)  # 2 blocks
    manager.fork("parent", "child")
    assert manager.free("parent") == 0 and "parent" not in manager.tables
    assert manager.free_blocks == 2
    assert manager.free("child") == 2
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
    manager.check_consistent()


@pytest.mark.exercise("ch08.1")
def test_copy_on_write_gives_the_writer_a_private_last_block() -> None:
    manager = BlockManager(4, 2)
    manager.allocate("a", 4)
    manager.fork("a", "b")
    shared = manager.tables["a"][-1]
    source, destination = manager.make_last_block_writable("b")
    assert source == shared and manager.tables["b"][-1] == destination != shared
    assert manager.ref_counts[shared] == 1 and manager.make_last_block_writable("b") is None
    manager.check_consistent()
