"""Chapter 8's automatic prefix caching: the block manager's cache, the scheduler over it, the server's figures.

Units drive :class:`BlockManager` directly (least-recently-released eviction, a hit after the owner
left, the chain, duplicates, all or nothing); the property test is beside the manager's others
(``test_ch08_block_manager.py``). The scheduler runs the fake model of ``test_ch08_scheduler.py``,
whose next token depends on every key and value read back through the paged cache, so a cached
block with the wrong contents, or attention that misreads a first chunk starting past 0, gives a
wrong token (``gather`` attention: the fake model's ``flex`` compiles for long). Then the real
default model in FP32 must return exactly the oracle's tokens with caching on, for concurrent
requests that share long prefixes and some that do not, with a pool small enough to preempt: through the
kernel in the fast suite, through gather and flex too with ``make test-slow`` (gather's cached reads are the
fake model's above).
"""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_ch08_block_manager import assert_consistent
from test_ch08_scheduler import FAKE_CONFIG, FakePackedModel, FakeRunner, fake_oracle, fake_setup, prompt, run_and_check
from test_ch08_server import run, settings

from chapter_flags import attention_here
from chapters.ch03_dynamic_batching.step_loop import run_step
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch08_continuous_batching.block_manager import BlockManager, OutOfBlocks
from chapters.ch08_continuous_batching.model_runner import ModelRunner
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence, Status
from chapters.ch08_continuous_batching.server import ContinuousSettings, build_app
from shared.settings import parse_settings

# -- the block manager --------------------------------------------------------------------------


def computed(manager: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """A sequence that looked up its prefix, got its blocks, and computed all its tokens: what a step does."""
    manager.allocate(seq_id, len(tokens), manager.cached_prefix(tokens))
    manager.cache_full_blocks(seq_id, tokens, len(tokens))
    return manager.tables[seq_id]


def test_a_finished_sequences_full_blocks_are_found_by_the_next_one_with_the_same_prefix() -> None:
    manager = BlockManager(8, 2, prefix_caching=True)
    first = computed(manager, "a", [1, 2, 3, 4, 5])  # blocks for [1 2] [3 4] [5]; the first two are full
    assert manager.cached_blocks == 2
    assert manager.free("a") == 3 and manager.free_blocks == 8, "cached blocks are free memory"
    cached = manager.cached_prefix([1, 2, 3, 4, 9, 9])
    assert cached.blocks == (first[0], first[1]) and cached.tokens == 4
    table = manager.allocate("b", 6, cached)
    assert table[:2] == first[:2] and manager.ref_counts[first[0]] == manager.ref_counts[first[1]] == 1
    assert manager.free_blocks == 8 - 3, "the two hits left the free queue, one new block"
    assert (manager.lookups_tokens, manager.hits_tokens) == (5 + 6, 4)
    held = manager.allocate("c", 5, manager.cached_prefix([1, 2, 3, 4, 7]))  # a hit on blocks b holds
    assert held[:2] == first[:2] and manager.ref_counts[first[0]] == 2
    assert_consistent(manager)


def test_only_full_blocks_before_the_last_token_are_reused() -> None:
    manager = BlockManager(8, 2, prefix_caching=True)
    computed(manager, "a", [1, 2, 3, 4, 5, 6])  # three full blocks, all cached
    manager.free("a")
    assert manager.cached_prefix([1, 2, 3, 4, 5, 6]).tokens == 4, "the last token is computed again: its logits give the next"
    assert manager.cached_prefix([1, 2, 3, 4, 5, 6, 7]).tokens == 6
    assert manager.cached_prefix([1, 2, 3]).tokens == 2
    assert manager.cached_prefix([1, 2]).tokens == 0 and manager.cached_prefix([1]).tokens == 0


def test_no_hit_across_different_prefixes_that_share_a_later_blocks_tokens() -> None:
    manager = BlockManager(8, 2, prefix_caching=True)
    computed(manager, "a", [1, 2, 3, 4, 5, 6, 0])
    assert manager.cached_prefix([9, 9, 3, 4, 5, 6, 0]).blocks == (), "[3 4] after [9 9] is not [3 4] after [1 2]"
    assert manager.cached_prefix([1, 2, 9, 9, 5, 6, 0]).tokens == 2, "the chain breaks at the first difference"
    assert manager.cached_prefix([3, 4, 5, 6, 0]).blocks == (), "the same tokens at another position"


def test_free_cached_blocks_are_evicted_least_recently_released_first_and_a_hit_refreshes_them() -> None:
    manager = BlockManager(6, 2, prefix_caching=True)
    a = computed(manager, "a", [1, 2, 9])  # [1 2] cached in block 0, [9] in block 1
    b = computed(manager, "b", [3, 4, 9])  # [3 4] cached in block 2, [9] in block 3
    manager.free("a")
    manager.free("b")  # the queue: 4, 5 (never used), 1, 0 (a's, tail first), 3, 2 (b's)
    assert manager.allocate("x", 4) == [4, 5], "never used blocks first: nothing cached is forgotten"
    c = manager.allocate("c", 3, manager.cached_prefix([1, 2, 7]))  # a hit takes block 0 out of the middle of the queue
    assert c == [a[0], a[1]] and manager.evictions == 0
    manager.free("c")  # a's blocks are now the most recently released: 3, 2, 1, 0
    assert manager.allocate("y", 2) == [b[1]] and manager.evictions == 0, "b's partial block was never cached"
    assert manager.allocate("z", 2) == [b[0]] and manager.evictions == 1, "b's cached block is the least recently released"
    assert manager.cached_prefix([3, 4, 9]).tokens == 0
    assert manager.cached_prefix([1, 2, 9]).tokens == 2, "the block a hit refreshed outlived one released after it first"
    assert_consistent(manager)


def test_two_equal_blocks_computed_side_by_side_keep_the_first_identity() -> None:
    manager = BlockManager(8, 2, prefix_caching=True)
    for seq_id in ("a", "b"):  # both admitted before either computed anything: no hit
        manager.allocate(seq_id, 3, manager.cached_prefix([1, 2, 3]))
    first, second = manager.tables["a"][0], manager.tables["b"][0]
    assert manager.cache_full_blocks("a", [1, 2, 3], 3) == 1
    assert manager.cache_full_blocks("b", [1, 2, 3], 3) == 0, "the identity is taken: b's copy stays anonymous"
    assert manager.cached_blocks == 1 and manager.cached_prefix([1, 2, 0]).blocks == (first,)
    manager.free("a")
    manager.free("b")
    assert manager.cached_prefix([1, 2, 0]).blocks == (first,) and second != first
    assert_consistent(manager)


def test_a_block_is_registered_only_once_its_last_position_is_computed() -> None:
    manager = BlockManager(8, 4, prefix_caching=True)
    tokens = list(range(10))
    manager.allocate("a", 10)
    assert manager.cache_full_blocks("a", tokens, 3) == 0, "three of four positions: not yet"
    assert manager.cache_full_blocks("a", tokens, 4) == 1
    assert manager.cache_full_blocks("a", tokens, 7) == 0
    assert manager.cache_full_blocks("a", tokens, 10) == 1 and manager.cached_blocks == 2
    assert_consistent(manager)


def test_allocation_with_a_prefix_is_all_or_nothing() -> None:
    manager = BlockManager(4, 2, prefix_caching=True)
    a = computed(manager, "a", [1, 2, 3, 4])
    manager.free("a")
    manager.allocate("hog", 2)  # takes a never-used block: 3 free, two of them cached
    cached = manager.cached_prefix([1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocks):
        manager.allocate("b", 9, cached)  # two hits + three new blocks > three free
    assert "b" not in manager.tables and manager.free_blocks == 3 and manager.ref_counts[a[0]] == 0
    assert (manager.lookups_tokens, manager.hits_tokens) == (4, 0), "a refused allocation counts no lookup"
    assert manager.cached_prefix([1, 2, 3, 4, 5]).tokens == 4
    assert_consistent(manager)


def test_without_prefix_caching_nothing_is_hashed_or_shared() -> None:
    manager = BlockManager(8, 2)
    computed(manager, "a", [1, 2, 3, 4, 5])
    manager.free("a")
    assert manager.cached_prefix([1, 2, 3, 4, 5]).blocks == () and manager.cached_blocks == 0
    assert_consistent(manager)


# -- the scheduler, fake model --------------------------------------------------------------------


def caching_setup(max_num_seqs: int, budget: int, policy: str = "grow", blocks: int = 32, block_tokens: int = 4,
                  attention: str = "gather") -> tuple[ContinuousScheduler, FakeRunner]:
    store = PagedKVStore(KVMemoryPool(FAKE_CONFIG, blocks * block_tokens, block_tokens=block_tokens), prefix_caching=True)
    scheduler = ContinuousScheduler(store, SchedulerConfig(max_num_seqs, budget, policy))
    return scheduler, FakeRunner(FakePackedModel(), store, attention_here(attention, store))


@pytest.mark.parametrize(("length", "reused"), [(40, 36), (41, 40)])
def test_a_second_request_with_the_same_prompt_computes_only_what_is_not_cached(length: int, reused: int) -> None:
    scheduler, model = caching_setup(max_num_seqs=2, budget=64)
    tokens = prompt(length, 300)
    first = Sequence(tokens, 3)
    run_and_check(scheduler, model, [first])
    assert scheduler.stats.prefill_tokens == length
    second = Sequence(tokens, 3)
    scheduler.add(second)
    step = scheduler.schedule()
    # 41 tokens: 40 cached, the last one alone is a one-token prompt chunk reading 40 positions from the pool
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(second, reused, length - reused)]
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert scheduler.stats.prefill_tokens == length + length - reused, "the budget paid only for what was computed"
    assert second.output_ids == first.output_ids == fake_oracle(tokens, 3)
    figures = scheduler.describe()["prefix_cache"]
    assert (figures["lookups_tokens"], figures["hits_tokens"]) == (2 * length, reused)
    assert figures["hit_rate"] == round(reused / (2 * length), 4) and figures["cached_blocks"] >= reused // 4
    assert_consistent(scheduler.manager)


def test_caching_off_by_default_recomputes_the_whole_prompt() -> None:
    scheduler, model = fake_setup(max_num_seqs=2, budget=64, blocks=32)
    tokens = prompt(40, 301)
    run_and_check(scheduler, model, [Sequence(tokens, 2)])
    run_and_check(scheduler, model, [Sequence(tokens, 2)])
    assert scheduler.stats.prefill_tokens == 80
    assert scheduler.describe()["prefix_cache"] == {"enabled": False, "lookups_tokens": 0, "hits_tokens": 0, "hit_rate": None,
                                                    "cached_blocks": 0, "evictions": 0}


def test_a_preempted_sequence_resumes_from_its_own_blocks_still_cached() -> None:
    scheduler, model = caching_setup(max_num_seqs=2, budget=64)
    seq = Sequence(prompt(18, 310), 10)
    scheduler.add(seq)
    for _ in range(3):
        run_step(scheduler, model)  # the prompt, then two decodes: 20 positions computed, 5 full blocks
    assert seq.num_computed == 20 and len(seq.token_ids) == 21
    scheduler.preempt(seq)
    assert seq.num_computed == 0 and scheduler.manager.free_blocks == scheduler.manager.total_blocks
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(seq, 20, 1)], "only the last token is computed again"
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert seq.output_ids == fake_oracle(seq.prompt_ids, 10)


def test_reserve_still_takes_the_whole_life_when_the_prompt_is_cached() -> None:
    scheduler, model = caching_setup(max_num_seqs=2, budget=64, policy="reserve")
    tokens = prompt(20, 320)
    run_and_check(scheduler, model, [Sequence(tokens, 4)])
    second = Sequence(tokens, 10)
    scheduler.add(second)
    step = scheduler.schedule()
    assert [(r.start, r.length) for r in step.rows] == [(16, 4)]
    assert len(scheduler.manager.tables[second.seq_id]) == scheduler.manager.blocks_for(second.peak_kv_tokens)
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert second.output_ids == fake_oracle(tokens, 10) and scheduler.stats.preemptions == 0


def test_shared_prefixes_under_preemption_and_abort_keep_the_ledger_right_and_free_everything() -> None:
    # 16 blocks of 4 tokens: three sequences of up to 40 positions cannot all stay; three share 3 blocks of prompt.
    scheduler, model = caching_setup(max_num_seqs=3, budget=16, blocks=16)
    common = prompt(13, 330)
    seqs = [Sequence(common + prompt(2, 331), 24), Sequence(prompt(9, 332), 14),
            Sequence(common + prompt(4, 333), 24), Sequence(common + prompt(1, 334), 20)]
    dropped = seqs[1]
    scheduler.add(seqs[0])
    steps = 0
    while steps < 12 or scheduler.has_work:
        if steps == 2:  # the first has computed the common blocks; the others arrive
            for seq in seqs[1:]:
                scheduler.add(seq)
        if steps == 12:
            assert scheduler.abort(dropped) and dropped.status is Status.ABORTED
        run_step(scheduler, model)
        assert_consistent(scheduler.manager)
        steps += 1
    kept = [s for s in seqs if s is not dropped]
    for seq in kept:
        assert seq.status is Status.FINISHED and seq.output_ids == fake_oracle(seq.prompt_ids, seq.max_new_tokens)
    manager = scheduler.manager
    assert scheduler.stats.preemptions > 0 and manager.hits_tokens >= 2 * 12 and manager.evictions > 0
    assert manager.free_blocks == manager.total_blocks and not manager.tables and all(c == 0 for c in manager.ref_counts)
    assert_consistent(manager)


def test_requests_arriving_together_with_one_prefix_compute_it_once() -> None:
    # 64 users with one system prompt, in small: the first computes the prefix; the others wait for
    # its blocks instead of computing them beside it, and a request with another prompt goes ahead.
    scheduler, model = caching_setup(max_num_seqs=8, budget=64, blocks=64)
    common = prompt(16, 340)  # 4 full blocks of 4
    same = [Sequence(common + prompt(3, 341 + i), 4) for i in range(4)]
    other = Sequence(prompt(10, 350), 4)
    for seq in (*same, other):
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(same[0], 0, 19), (other, 0, 10)]
    assert list(scheduler.waiting) == same[1:], "the held keep their places"
    scheduler.update(step, step.execute(model))
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.prefill_rows] == [(seq, 16, 3) for seq in same[1:]]
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert scheduler.stats.prefill_tokens == 19 + 10 + 3 * 3, "the prefix computed once"
    assert scheduler.manager.hits_tokens == 3 * 16
    for seq in (*same, other):
        assert seq.output_ids == fake_oracle(seq.prompt_ids, 4)


def test_a_request_waits_for_the_block_a_chunked_prompt_is_computing_and_not_longer() -> None:
    scheduler, model = caching_setup(max_num_seqs=4, budget=12, blocks=64)
    common = prompt(16, 360)
    first, second = Sequence(common + prompt(3, 361), 3), Sequence(common + prompt(2, 362), 3)
    scheduler.add(first)
    run_step(scheduler, model)  # positions 0-11 of the first: three blocks cached
    scheduler.add(second)
    step = scheduler.schedule()  # the first's last 7 (block 3 among them), 5 of budget left
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(first, 12, 7)], "block 3 is being computed: wait"
    scheduler.update(step, step.execute(model))
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.prefill_rows] == [(second, 16, 2)], "then only its own 2"
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert second.output_ids == fake_oracle(second.prompt_ids, 3) and first.output_ids == fake_oracle(first.prompt_ids, 3)


# -- the real model, FP32: exactly the oracle's tokens with caching on ------------------------------


def shared_prefix_requests(seed: int) -> list[tuple[list[int], int]]:
    """Ten requests: two long prefixes (more than two 16-token blocks) with short distinct suffixes, and strangers."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(length)] for length in (40, 57)]
    requests = []
    for i in range(10):
        if i % 3 == 2:
            tokens = [rng.randrange(256) for _ in range(rng.randint(5, 60))]
        else:
            tokens = prefixes[i % 2] + [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        requests.append((tokens, rng.randint(32, 96)))
    return requests


@pytest.mark.parametrize(("attention", "pool_tokens"), [
    pytest.param("gather", 4096, marks=pytest.mark.slow),  # the small pool's runs share as many prefixes, and preempt too
    pytest.param("flex", 4096, marks=pytest.mark.slow),
    pytest.param("flex", 528, marks=pytest.mark.slow),  # its compilation is the cost; the other backends keep the small pool
    pytest.param("gather", 528, marks=pytest.mark.slow),  # the fast suite's time (module docstring)
    ("kernel", 528),
])
def test_concurrent_requests_sharing_long_prefixes_get_the_oracles_tokens(default_model, oracle, attention: str,
                                                                           pool_tokens: int) -> None:
    store = PagedKVStore(KVMemoryPool(default_model.config, pool_tokens, block_tokens=16), prefix_caching=True)
    scheduler = ContinuousScheduler(store, SchedulerConfig(8, 64, "grow"))
    runner = ModelRunner(default_model.model, store, attention_here(attention, store))
    manager = store.manager
    admissions: list[tuple[Sequence, int, int]] = []  # (sequence, its preemptions then, tokens found cached)
    allocate = manager.allocate

    def recording_allocate(seq_id, n_tokens, prefix=None):
        table = allocate(seq_id, n_tokens, prefix)
        seq = next(s for s in seqs if s.seq_id == seq_id)
        admissions.append((seq, seq.preemptions, prefix.tokens if prefix is not None else 0))
        return table

    manager.allocate = recording_allocate
    requests = shared_prefix_requests(seed=21)
    seqs = [Sequence(p, n) for p, n in requests]
    for seq in seqs[:3]:  # a first wave computes the prefixes; the rest arrive while it decodes
        scheduler.add(seq)
    for _ in range(3):
        run_step(scheduler, runner)
    for seq in seqs[3:]:
        scheduler.add(seq)
    while run_step(scheduler, runner):
        assert_consistent(manager)
    for seq, (p, n) in zip(seqs, requests):
        assert seq.output_ids == oracle(p, n), f"prompt of {len(p)}, {n} new tokens, {seq.preemptions} preemptions"
    assert sum(found for seq, preempted, found in admissions if not preempted and seq not in seqs[:3]) >= 4 * 32, (
        "the later requests of each prefix found at least two of its blocks")
    assert manager.free_blocks == manager.total_blocks
    if pool_tokens < 1000:  # the small pool preempted some, and at least one resumed from blocks still cached
        assert scheduler.stats.preemptions > 0 and any(found for _, preempted, found in admissions if preempted)


# -- the server: the setting, /stats, /metrics ------------------------------------------------------


def test_the_prefix_caching_setting_is_on_by_default_and_can_be_turned_off() -> None:
    assert ContinuousSettings().prefix_caching == "on"
    assert parse_settings(ContinuousSettings, ["--prefix-caching", "off"]).prefix_caching == "off"
    with pytest.raises(SystemExit):
        parse_settings(ContinuousSettings, ["--prefix-caching", "maybe"])


@pytest.mark.parametrize("setting", ["on", "off"])
def test_stats_and_metrics_report_the_prefix_cache(oracle, setting: str) -> None:
    app = build_app(settings(prefix_caching=setting, block_tokens=16))  # the server's 128 would hold no full block of 60
    tokens = list(range(40, 100))  # 60 tokens: three full blocks of 16 before the last token

    async def scenario(client: httpx.AsyncClient) -> None:
        for _ in range(2):  # one after the other: the second finds the first's blocks
            answer = await client.post("/v1/inference", json={"input_ids": tokens, "max_new_tokens": 5})
            assert answer.json()["output_ids"] == oracle(tokens, 5)
        stats = (await client.get("/stats")).json()
        figures = stats["scheduler"]["prefix_cache"]
        assert stats["prefix_caching"] == setting and figures["enabled"] is (setting == "on")
        assert figures["lookups_tokens"] == (4 + 60 + 60 if setting == "on" else 0)  # and the start-up probe's four
        assert figures["hits_tokens"] == (48 if setting == "on" else 0)
        assert (figures["cached_blocks"] > 0) is (setting == "on")
        samples = {s.name: s.value for f in text_string_to_metric_families((await client.get("/metrics")).text) for s in f.samples
                   if s.name.startswith("inference_prefix_cache")}
        assert samples == {"inference_prefix_cache_lookup_tokens_total": figures["lookups_tokens"],
                           "inference_prefix_cache_hit_tokens_total": figures["hits_tokens"],
                           "inference_prefix_cache_blocks": figures["cached_blocks"]}

    run(app, scenario)
