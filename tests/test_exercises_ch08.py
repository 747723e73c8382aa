"""Graded tests of chapter 8's exercises: paged allocation (ch08.1), admission under two budgets (ch08.2),
preemption by recompute (ch08.3), the packed step's inputs (ch08.4), the slot mapping (ch08.5), the
block hash chain of prefix caching (ch08.6), top-p sampling (ch08.7, against a brute-force nucleus and
the real model's distribution).

Pure bookkeeping and a fake model: the block manager is checked against a plain oracle (a FIFO free
list and a count per block), the scheduler with the fake model of ``test_ch08_scheduler.py``, whose
next token depends on every token read back through the paged cache, so a wrong table, offset or
resume gives a wrong token. Everything is synchronous: a stub raises in the call that needs it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_oracle import brute_force_nucleus, model_logits
from test_ch08_block_manager import assert_consistent
from test_ch08_scheduler import (
    FAKE_CONFIG,
    fake_oracle,
    fake_setup,
    prompt,
    run_and_check,
)

from chapters.ch03_dynamic_batching.step_loop import run_step
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch08_continuous_batching.block_manager import ROOT_HASH, BlockManager, CachedPrefix, OutOfBlocks, block_hash
from chapters.ch08_continuous_batching.model_runner import pack_rows
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.sampling import SamplingParams, keep_top_p, sample_tokens
from chapters.ch08_continuous_batching.scheduler import Sequence, Status

# ----------------------------------------------------------------------------- ch08.1: paged allocation


@pytest.mark.exercise("ch08.1")
def test_blocks_come_whole_from_the_front_of_the_free_list_and_only_as_many_as_needed() -> None:
    manager = BlockManager(8, 4)
    assert manager.allocate("a", 5) == [0, 1], "5 tokens: two blocks of 4, the first two free"
    assert manager.allocate("b", 4) == [2]
    assert manager.grow_to("a", 8) == [0, 1], "8 tokens still fit in two blocks: nothing taken"
    assert manager.grow_to("a", 9) == [0, 1, 3]
    assert manager.grow_to("a", 2) == [0, 1, 3], "a table never shrinks"
    assert [manager.ref_counts[b] for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert (manager.free_blocks, manager.used_blocks) == (4, 4)
    assert_consistent(manager)


@pytest.mark.exercise("ch08.1")
def test_growing_is_all_or_nothing() -> None:
    manager = BlockManager(4, 2)
    manager.allocate("a", 4)  # blocks 0, 1
    with pytest.raises(OutOfBlocks):
        manager.grow_to("a", 10)  # needs 3 more, 2 are free
    assert manager.tables["a"] == [0, 1] and manager.free_blocks == 2
    assert manager.grow_to("a", 8) == [0, 1, 2, 3] and manager.free_blocks == 0
    assert_consistent(manager)


@pytest.mark.exercise("ch08.1")
def test_free_returns_unshared_blocks_to_the_back_of_the_free_list() -> None:
    manager = BlockManager(6, 2)
    manager.allocate("a", 4)  # 0, 1
    manager.allocate("b", 2)  # 2
    assert manager.free("a") == 2 and "a" not in manager.tables
    assert manager.allocate("c", 6) == [3, 4, 5], "blocks never used come before the ones just freed"
    assert manager.allocate("d", 4) == [1, 0], "then the freed ones, in the order they went back (tail first)"
    assert_consistent(manager)


@pytest.mark.exercise("ch08.1")
def test_a_block_shared_by_a_cached_prefix_stays_until_its_last_holder_frees_it() -> None:
    manager = BlockManager(4, 2)
    manager.allocate("first", 5)  # blocks 0, 1, 2
    shared = CachedPrefix(blocks=(0, 1), hashes=(b"0", b"1"), queried_tokens=5, block_tokens=2)  # as prefix caching finds them
    manager.allocate("second", 5, shared)  # shares 0 and 1, takes 3
    assert manager.tables["second"] == [0, 1, 3]
    assert manager.free("first") == 1 and manager.free_blocks == 1, "only block 2 was first's alone"
    assert [manager.ref_counts[b] for b in manager.tables["second"]] == [1, 1, 1]
    assert manager.free("second") == 3 and manager.free_blocks == 4
    assert all(count == 0 for count in manager.ref_counts)


@pytest.mark.exercise("ch08.1")
@settings(derandomize=True, max_examples=80, deadline=None)  # the same examples every run: a grade must not flicker
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 13)), max_size=40))
def test_tables_and_the_free_list_follow_a_plain_oracle(operations: list[tuple[bool, int, int]]) -> None:
    total, size = 10, 3
    manager = BlockManager(total, size)
    free: deque[int] = deque(range(total))  # the oracle: a FIFO free list and a table per sequence
    tables: dict[int, list[int]] = {}
    for grow, seq, tokens in operations:
        if grow:
            table = tables.get(seq, [])
            needed = max(0, -(-tokens // size) - len(table))
            if needed > len(free):
                with pytest.raises(OutOfBlocks):
                    manager.grow_to(seq, tokens) if seq in tables else manager.allocate(seq, tokens)
            else:
                expected = table + [free.popleft() for _ in range(needed)]
                got = manager.grow_to(seq, tokens) if seq in tables else manager.allocate(seq, tokens)
                assert got == expected
                tables[seq] = expected
        elif seq in tables:
            released = tables.pop(seq)
            assert manager.free(seq) == len(released)
            free.extend(reversed(released))
        assert {s: list(t) for s, t in manager.tables.items()} == tables
        assert manager.free_blocks == len(free)
        assert_consistent(manager)


# ----------------------------------------------------------------------------- ch08.2: admission


@pytest.mark.exercise("ch08.2")
def test_no_more_than_max_num_seqs_run_and_a_freed_row_is_taken_at_the_next_step() -> None:
    scheduler, model = fake_setup(max_num_seqs=2, budget=64)
    seqs = [Sequence(prompt(3, 40 + i), n) for i, n in enumerate((1, 4, 2))]
    for seq in seqs:
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(seqs[0], 0, 3), (seqs[1], 0, 3)]
    assert list(scheduler.waiting) == [seqs[2]]
    scheduler.update(step, step.execute(model))
    assert seqs[0].status is Status.FINISHED
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(seqs[1], 3, 1), (seqs[2], 0, 3)]
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert [s.output_ids for s in seqs] == [fake_oracle(s.prompt_ids, s.max_new_tokens) for s in seqs]


@pytest.mark.exercise("ch08.2")
def test_the_token_budget_cuts_the_last_admitted_prompt_into_a_chunk() -> None:
    scheduler, model = fake_setup(max_num_seqs=4, budget=12)
    first, second, third = Sequence(prompt(8, 50), 2), Sequence(prompt(8, 51), 2), Sequence(prompt(8, 52), 2)
    for seq in (first, second, third):
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(first, 0, 8), (second, 0, 4)], "8 + 4 = the budget of 12"
    assert list(scheduler.waiting) == [third], "no budget left: the third waits"
    assert len(scheduler.manager.tables[second.seq_id]) == 1, "grow: blocks for the 4-token chunk only"
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert [s.output_ids for s in (first, second, third)] == [fake_oracle(s.prompt_ids, 2) for s in (first, second, third)]


@pytest.mark.exercise("ch08.2")
def test_nobody_overtakes_a_head_of_the_queue_that_does_not_fit() -> None:
    # reserve: a sequence takes the blocks of its whole life when admitted. 16 blocks of 4 tokens.
    scheduler, model = fake_setup(max_num_seqs=4, budget=64, policy="reserve")
    big, huge, small = Sequence(prompt(20, 60), 20), Sequence(prompt(20, 61), 10), Sequence(prompt(2, 62), 1)
    for seq in (big, huge, small):
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [r.seq for r in step.rows] == [big], "huge needs 8 blocks of the 6 left; small fits but must not overtake it"
    assert list(scheduler.waiting) == [huge, small] and scheduler.manager.used_blocks == 10
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert [s.output_ids for s in (big, huge, small)] == [fake_oracle(s.prompt_ids, s.max_new_tokens) for s in (big, huge, small)]


# ----------------------------------------------------------------------------- ch08.3: preemption


@pytest.mark.exercise("ch08.3")
def test_preempt_frees_the_blocks_keeps_the_tokens_and_puts_the_sequence_first_in_line() -> None:
    scheduler, model = fake_setup(max_num_seqs=4, budget=64)
    older, newer, queued = Sequence(prompt(6, 70), 5), Sequence(prompt(6, 71), 5), Sequence(prompt(6, 72), 5)
    scheduler.add(older), scheduler.add(newer)
    run_step(scheduler, model)
    run_step(scheduler, model)
    scheduler.add(queued)
    tokens = list(newer.token_ids)
    free_before = scheduler.manager.free_blocks
    held = len(scheduler.manager.tables[newer.seq_id])
    scheduler.preempt(newer)
    assert scheduler.running == [older] and scheduler.waiting[0] is newer, "back at the HEAD of the queue"
    assert newer.status is Status.WAITING and newer.num_computed == 0 and newer.token_ids == tokens
    assert newer.seq_id not in scheduler.manager.tables and scheduler.manager.free_blocks == free_before + held
    assert (newer.preemptions, scheduler.stats.preemptions) == (1, 1)
    run_and_check(scheduler, model, [])
    for seq in (older, newer, queued):
        assert seq.output_ids == fake_oracle(seq.prompt_ids, 5), "recomputed from its tokens: the same answer"


@pytest.mark.exercise("ch08.3")
def test_when_decodes_are_short_of_blocks_the_newest_is_preempted_never_the_oldest() -> None:
    # 16 blocks of 4 tokens; two sequences that each reach 39 positions (10 blocks) cannot both stay.
    scheduler, model = fake_setup(max_num_seqs=2, budget=64)
    oldest, newest = Sequence(prompt(20, 80), 20), Sequence(prompt(20, 81), 20)
    run_and_check(scheduler, model, [oldest, newest])
    assert oldest.preemptions == 0 and newest.preemptions >= 1
    assert scheduler.stats.preemptions == newest.preemptions


def three_prefilled() -> tuple:
    """Three running sequences of one block each, and every other block held outside the scheduler."""
    scheduler, model = fake_setup(max_num_seqs=3, budget=64)
    seqs = [Sequence(prompt(4, 90 + i), 6) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, model)  # three prompt passes: one block each
    manager = scheduler.manager
    manager.allocate("hog", manager.free_blocks * manager.block_tokens)  # nothing free any more
    return scheduler, model, seqs


@pytest.mark.exercise("ch08.3")
def test_make_room_preempts_from_the_newest_until_the_sequence_fits() -> None:
    scheduler, model, (a, b, c) = three_prefilled()
    assert scheduler._make_room(a, 9) is True  # 9 positions: 3 blocks, 2 more than a holds
    assert scheduler.running == [a] and list(scheduler.waiting) == [b, c], "c went first, then b, each to the head"
    assert len(scheduler.manager.tables[a.seq_id]) == 3 and scheduler.manager.free_blocks == 0
    assert (a.preemptions, b.preemptions, c.preemptions) == (0, 1, 1)
    scheduler.manager.free("hog")
    run_and_check(scheduler, model, [])
    assert [s.output_ids for s in (a, b, c)] == [fake_oracle(s.prompt_ids, 6) for s in (a, b, c)]


@pytest.mark.exercise("ch08.3")
def test_a_sequence_that_is_itself_the_newest_gives_way() -> None:
    scheduler, _model, (a, b, c) = three_prefilled()
    assert scheduler._make_room(c, 8) is False
    assert scheduler.running == [a, b] and list(scheduler.waiting) == [c] and c.status is Status.WAITING
    assert c.seq_id not in scheduler.manager.tables and scheduler.manager.free_blocks == 1


# ----------------------------------------------------------------------------- ch08.4: packed inputs


@dataclass(frozen=True)
class Row:
    """A planned row as the runner sees it (the scheduler's ``ScheduledRow`` has the same fields)."""

    seq_id: int
    new_ids: list[int]
    start: int
    samples: bool


@pytest.mark.exercise("ch08.4")
def test_rows_are_flattened_with_positions_cumulative_lengths_and_logits_only_where_a_token_is_sampled() -> None:
    rows = [Row(1, [9], 9, True), Row(2, [4], 4, True), Row(3, [10, 11, 12, 13], 0, True), Row(4, [16, 17, 18], 16, False)]
    input_ids, positions, query_start, logits_indices = pack_rows(rows)
    assert input_ids == [9, 4, 10, 11, 12, 13, 16, 17, 18]
    assert positions == [9, 4, 0, 1, 2, 3, 16, 17, 18], "each token's position in ITS sequence"
    assert query_start == [0, 1, 2, 6, 9], "row i owns tokens query_start[i] .. query_start[i + 1] - 1"
    assert logits_indices == [0, 1, 5], "the last token of each SAMPLING row; row 4 is a partial prompt chunk"


@pytest.mark.exercise("ch08.4")
def test_a_step_of_only_partial_chunks_asks_for_no_logits() -> None:
    assert pack_rows([Row(7, [1, 2], 30, False)]) == ([1, 2], [30, 31], [0, 2], [])
    assert pack_rows([]) == ([], [], [0], [])


# ----------------------------------------------------------------------------- ch08.5: the slot mapping


@pytest.mark.exercise("ch08.5")
def test_each_position_maps_to_its_block_and_offset_through_the_table() -> None:
    pool = KVMemoryPool(FAKE_CONFIG, 16 * 4, block_tokens=4)
    store = PagedKVStore(pool)
    store.manager.allocate("other", 4)  # block 0
    store.manager.allocate("a", 6)  # blocks 1, 2
    store.manager.allocate("b", 4)  # block 3
    store.manager.grow_to("a", 9)  # block 4: a's table is [1, 2, 4]
    assert store.manager.tables["a"] == [1, 2, 4]
    assert store.slots("a", 0, 9) == [4, 5, 6, 7, 8, 9, 10, 11, 16], "position p -> table[p // 4] * 4 + p % 4"
    assert store.slots("a", 7, 9) == [11, 16], "a later chunk starts mid-block"
    assert store.slots("b", 3, 4) == [15]


@pytest.mark.exercise("ch08.5")
def test_a_table_that_grew_after_other_sequences_took_blocks_is_not_contiguous() -> None:
    store = PagedKVStore(KVMemoryPool(FAKE_CONFIG, 16 * 4, block_tokens=4))
    store.manager.allocate("b", 3)  # block 0
    store.manager.allocate("c", 8)  # blocks 1, 2
    store.manager.grow_to("b", 9)  # blocks 3, 4: b's table is [0, 3, 4]
    assert store.slots("b", 0, 9) == [0, 1, 2, 3, 12, 13, 14, 15, 16]
    assert store.slots("b", 3, 5) == [3, 12], "a chunk may cross from one block to a distant one"


# ----------------------------------------------------------------------------- ch08.6: the block hash chain


@pytest.mark.exercise("ch08.6")
def test_a_blocks_identity_depends_on_its_tokens_their_order_and_its_parent() -> None:
    first = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) >= 16, "a cryptographic digest, not a 64-bit hash()"
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) == first == block_hash(ROOT_HASH, (1, 2, 3, 4)), "a pure function of the tokens"
    assert block_hash(ROOT_HASH, [1, 2, 4, 3]) != first, "the order of the tokens counts"
    assert block_hash(ROOT_HASH, [1, 2, 3, 5]) != first, "every token counts"
    second = block_hash(first, [1, 2, 3, 4])
    assert second != first, "the same tokens after another prefix are another block"
    assert block_hash(block_hash(ROOT_HASH, [9, 9, 9, 9]), [1, 2, 3, 4]) != second, "the parent's identity counts"


@pytest.mark.exercise("ch08.6")
def test_token_lists_a_loose_encoding_would_confuse_get_different_identities() -> None:
    confusable = [
        ([1, 23], [12, 3]),  # digits run together
        ([1, 256], [1, 0]),  # one byte per token
        ([0, 1], [256, 0]),  # one byte per token, the other way
        ([65536, 0], [0, 1]),  # two bytes per token
    ]
    for one, other in confusable:
        assert block_hash(ROOT_HASH, one) != block_hash(ROOT_HASH, other), (one, other)


@pytest.mark.exercise("ch08.6")
def test_the_cache_finds_a_prefix_only_through_the_whole_chain() -> None:
    manager = BlockManager(8, 2, prefix_caching=True)
    tokens = [5, 5, 6, 6, 7, 7, 0]
    manager.allocate("a", len(tokens))
    assert manager.cache_full_blocks("a", tokens, len(tokens)) == 3
    manager.free("a")
    assert manager.cached_prefix(tokens).tokens == 6
    assert manager.cached_prefix([9, 9, 6, 6, 7, 7, 0]).tokens == 0, "[6 6] after [9 9] is another block than after [5 5]"
    assert manager.cached_prefix([5, 5, 6, 1, 7, 7, 0]).tokens == 2, "the chain ends at the first difference"
    assert manager.cached_prefix([6, 6, 7, 7, 0]).tokens == 0, "the same tokens at another position"


# ----------------------------------------------------------------------------- ch08.7: top-p sampling


# Logits on a grid of 1/64: distinct logits, distinct probabilities. Arbitrary floats (0.0 beside 2e-134)
# give ties, and with a tie at the nucleus' edge "the smallest set" is not one set.
@given(st.lists(st.integers(-512, 512).map(lambda i: i / 64), min_size=2, max_size=40, unique=True), st.floats(0.05, 0.999))
@settings(max_examples=200, deadline=None)
@pytest.mark.exercise("ch08.7")
def test_top_p_keeps_exactly_the_smallest_most_likely_set_that_reaches_p(values: list[float], top_p: float) -> None:
    logits = torch.tensor(values, dtype=torch.float64)
    kept = {i for i, v in enumerate(keep_top_p(logits[None], torch.tensor([[top_p]]))[0].tolist()) if v != float("-inf")}
    assert kept == brute_force_nucleus(torch.softmax(logits, -1).tolist(), top_p)


@pytest.mark.exercise("ch08.7")
def test_top_p_of_one_keeps_everything_and_a_tiny_p_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [0.1, 3.0, -1.0, 2.9]])
    kept = keep_top_p(logits, torch.tensor([[1.0], [1e-6]]))  # each row its own p
    assert torch.equal(kept[0], logits[0])
    assert kept[1, 1] == 3.0 and torch.isinf(kept[1, [0, 2, 3]]).all()


@pytest.mark.exercise("ch08.7")
def test_sampled_tokens_never_leave_the_nucleus(default_model) -> None:
    logits = model_logits(default_model.model, list(b"Once upon a time, "))
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=3)
    nucleus = brute_force_nucleus(torch.softmax(logits, -1).tolist(), 0.8)
    generator = params.generator()
    drawn = {sample_tokens(logits[None], [params], [generator])[0][0] for _ in range(300)}
    assert drawn <= nucleus and len(drawn) > 1
