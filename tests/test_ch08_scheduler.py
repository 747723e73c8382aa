"""Chapter 8's continuous-batching scheduler on chapter 3's step loop.

Units drive it with a fake model whose next token is a known function of the whole sequence, read
back through the paged cache (so a wrong block table, offset or mask gives a wrong token): admission
under both budgets, chunked prefill offsets, preemption and resume. Then the real default model in
FP32 must return exactly the oracle's tokens for concurrent mixed requests, under both KV policies.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from chapters.ch03_dynamic_batching.step_loop import run_step, run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence, Status
from shared.model import ModelConfig

FAKE_CONFIG = ModelConfig(vocab_size=101, n_ctx=64, n_embd=2, n_layer=1, n_head=1)
PAD = 100


def fake_next(tokens: list[int]) -> int:
    """What the fake model answers after ``tokens``: depends on every token and on the length."""
    return (sum(tokens) * 31 + len(tokens) * 7) % FAKE_CONFIG.vocab_size


def fake_oracle(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(fake_next(tokens))
    return tokens[len(prompt):]


class FakeModel:
    """Stores each token id as its key, reads every visible key back through the cache, records each call."""

    config = FAKE_CONFIG
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def prefill(self, input_ids: Tensor, position_ids, attention_mask, cache) -> Tensor:
        assert cache.seq_len == 0
        return self._step("prefill", input_ids, position_ids, attention_mask, cache)

    def decode(self, input_ids: Tensor, position_ids, attention_mask, cache) -> Tensor:
        assert cache.seq_len > 0
        return self._step("decode", input_ids, position_ids, attention_mask, cache)

    def _step(self, kind: str, input_ids: Tensor, position_ids, attention_mask, cache) -> Tensor:
        batch, new = input_ids.shape
        self.calls.append({"kind": kind, "rows": batch, "new": new, "past": cache.seq_len, "positions": position_ids.tolist()})
        key = torch.stack([input_ids.float(), torch.ones_like(input_ids, dtype=torch.float)], dim=-1)[:, None]  # (B, 1, T, 2)
        keys, _ = cache.update(0, key, key.clone())
        cache.advance(new)
        visible = torch.ones(keys.shape[:1] + keys.shape[2:3]) if attention_mask is None else attention_mask.float()
        total = (keys[:, 0, :, 0] * visible).sum(dim=1)
        count = (keys[:, 0, :, 1] * visible).sum(dim=1)
        next_ids = ((total.round().long() * 31 + count.round().long() * 7) % FAKE_CONFIG.vocab_size)
        return torch.nn.functional.one_hot(next_ids, FAKE_CONFIG.vocab_size).float()


def fake_scheduler(max_num_seqs: int, budget: int, policy: str = "grow", blocks: int = 16, block_tokens: int = 4) -> ContinuousScheduler:
    pool = KVMemoryPool(FAKE_CONFIG, blocks * block_tokens, block_tokens=block_tokens)
    return ContinuousScheduler(PagedKVStore(pool), SchedulerConfig(max_num_seqs, budget, policy), PAD)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PAD) for _ in range(n)]


def run_and_check(scheduler: ContinuousScheduler, model: FakeModel, seqs: list[Sequence]) -> None:
    for seq in seqs:
        scheduler.add(seq)
    while run_step(scheduler, model):
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        scheduler.manager.check_consistent()
    for seq in seqs:
        assert seq.status is Status.FINISHED
        assert seq.output_ids == fake_oracle(seq.prompt_ids, seq.max_new_tokens)
    assert scheduler.manager.free_blocks == scheduler.manager.total_blocks


@pytest.mark.exercise("ch08.2")
def test_admission_stops_at_max_num_seqs_and_a_finished_sequence_frees_its_row_at_once() -> None:
    scheduler, model = fake_scheduler(max_num_seqs=2, budget=64), FakeModel()
    short, long_, third = Sequence(prompt(3, 1), 1), Sequence(prompt(3, 2), 5), Sequence(prompt(3, 3), 2)
    for seq in (short, long_, third):
        scheduler.add(seq)
    run_step(scheduler, model)  # admits two; `short` is done after its prompt pass
    assert short.status is Status.FINISHED and list(scheduler.running) == [long_] and list(scheduler.waiting) == [third]
    run_step(scheduler, model)  # `third` joins while `long_` decodes: no waiting for the batch's end
    assert scheduler.running == [long_, third]
    assert model.calls[-2]["rows"] == 1 and model.calls[-2]["new"] == 1  # long_'s decode
    assert model.calls[-1]["kind"] == "prefill" and model.calls[-1]["new"] == 3  # third's prompt
    run_and_check(scheduler, model, [])
    assert long_.output_ids == fake_oracle(long_.prompt_ids, 5)


@pytest.mark.exercise("ch08.2")
def test_the_token_budget_chunks_prompts_at_the_right_offsets() -> None:
    scheduler, model = fake_scheduler(max_num_seqs=4, budget=16), FakeModel()
    first, second, third = Sequence(prompt(10, 4), 3), Sequence(prompt(10, 5), 3), Sequence(prompt(10, 6), 3)
    for seq in (first, second, third):
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(first, 0, 10), (second, 0, 6)]
    scheduler.update(step, step.execute(model))
    assert first.num_generated == 1 and second.num_generated == 0 and second.num_computed == 6
    step = scheduler.schedule()  # first decodes (1), second's next chunk (4), third gets what is left (11 -> 10)
    assert [(r.seq, r.start, r.length) for r in step.rows] == [(first, 10, 1), (second, 6, 4), (third, 0, 10)]
    assert sum(r.length for r in step.rows) <= 16
    scheduler.update(step, step.execute(model))
    run_and_check(scheduler, model, [])
    assert [s.output_ids for s in (first, second, third)] == [fake_oracle(s.prompt_ids, 3) for s in (first, second, third)]


@pytest.mark.exercise("ch08.2")
def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_then_sampled_once() -> None:
    scheduler, model = fake_scheduler(max_num_seqs=2, budget=16), FakeModel()
    seq = Sequence(prompt(40, 7), 2)
    scheduler.add(seq)
    run_until_done(scheduler, model)
    # (the position of each call's first new token: the positions already cached, whatever the layout)
    assert [(c["positions"][0][0], c["new"]) for c in model.calls] == [(0, 16), (16, 16), (32, 8), (40, 1)]
    assert model.calls[1]["positions"] == [list(range(16, 32))]
    assert seq.output_ids == fake_oracle(seq.prompt_ids, 2)


@pytest.mark.exercise("ch08.3")
def test_grow_preempts_the_newest_by_recompute_and_every_sequence_still_gets_the_oracles_tokens() -> None:
    # 16 blocks of 4 tokens; three sequences that each reach 39 positions (10 blocks) cannot all stay.
    scheduler, model = fake_scheduler(max_num_seqs=3, budget=64, policy="grow"), FakeModel()
    seqs = [Sequence(prompt(20, 10 + i), 20) for i in range(3)]
    run_and_check(scheduler, model, seqs)
    assert scheduler.stats.preemptions > 0
    assert seqs[0].preemptions == 0  # the oldest is never the victim
    assert any(s.preemptions for s in seqs[1:])


@pytest.mark.exercise("ch08.2")
def test_reserve_admits_only_what_fits_whole_and_never_preempts() -> None:
    scheduler, model = fake_scheduler(max_num_seqs=3, budget=64, policy="reserve"), FakeModel()
    seqs = [Sequence(prompt(20, 20 + i), 20) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, model)
    assert scheduler.running == [seqs[0]]  # 10 blocks reserved; the next needs 10 more of the 6 left
    assert scheduler.manager.used_blocks == 10
    run_and_check(scheduler, model, [])
    assert scheduler.stats.preemptions == 0
    assert [s.output_ids for s in seqs] == [fake_oracle(s.prompt_ids, 20) for s in seqs]


def test_abort_frees_the_blocks_before_the_next_step() -> None:
    scheduler, model = fake_scheduler(max_num_seqs=4, budget=64), FakeModel()
    kept, dropped = Sequence(prompt(9, 30), 10), Sequence(prompt(9, 31), 10)
    scheduler.add(kept), scheduler.add(dropped)
    run_step(scheduler, model)
    used = scheduler.manager.used_blocks
    assert scheduler.abort(dropped) and dropped.status is Status.ABORTED
    assert scheduler.manager.used_blocks == used - 3  # its 9 prompt positions + 1: 3 blocks of 4
    run_and_check(scheduler, model, [])
    assert kept.output_ids == fake_oracle(kept.prompt_ids, 10)


# -- the real model, FP32: exactly the oracle's tokens --------------------------------------------


def mixed_requests(n: int, seed: int, max_new: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(4, 128))], rng.randint(1, max_new)) for _ in range(n)]


def real_scheduler(default_model, policy: str, pool_tokens: int, max_num_seqs: int = 16, budget: int = 128) -> ContinuousScheduler:
    config = default_model.config
    pool = KVMemoryPool(config, pool_tokens, block_tokens=16)
    return ContinuousScheduler(PagedKVStore(pool), SchedulerConfig(max_num_seqs, budget, policy), default_model.tokenizer.pad_id)


def check_against_oracle(default_model, oracle, scheduler: ContinuousScheduler, requests) -> None:
    seqs = [Sequence(p, n) for p, n in requests]
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, default_model.model)
    for seq, (p, n) in zip(seqs, requests):
        assert seq.output_ids == oracle(p, n), f"prompt of {len(p)}, {n} new tokens, {seq.preemptions} preemptions"
    assert scheduler.manager.free_blocks == scheduler.manager.total_blocks


@pytest.mark.parametrize(("policy", "pool_tokens"), [("grow", 528), ("reserve", 4096)])
@pytest.mark.exercise("ch08.2")
def test_concurrent_mixed_requests_get_the_oracles_tokens(default_model, oracle, policy: str, pool_tokens: int) -> None:
    scheduler = real_scheduler(default_model, policy, pool_tokens, max_num_seqs=8, budget=64)
    check_against_oracle(default_model, oracle, scheduler, mixed_requests(12, seed=8, max_new=32))
    if policy == "grow":
        assert scheduler.stats.preemptions > 0  # the small pool forced some: resumed ones are checked too


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "pool_tokens"), [("grow", 1024), ("reserve", 8192)])
def test_64_concurrent_mixed_requests_get_the_oracles_tokens(default_model, oracle, policy: str, pool_tokens: int) -> None:
    scheduler = real_scheduler(default_model, policy, pool_tokens, max_num_seqs=32, budget=256)
    check_against_oracle(default_model, oracle, scheduler, mixed_requests(64, seed=64, max_new=64))
