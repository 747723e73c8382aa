"""Chapter 8's recorded decode steps (cuda_graphs.py): the static path on a CPU, the recorded one on a GPU.

The static path (``capture=False``) is the computation the graphs record: static buffers written in
place, padding rows writing a scratch slot and attending to nothing, the flex bucket's mask rewritten in
place. On a CPU it is checked against the oracle's tokens under chunked prefill and preemption; where
CUDA exists the same runs recorded, at fp32 against the oracle and at bf16 within chapter 5's tolerance.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from chapter_flags import MIN_TOKEN_AGREEMENT, attention_here
from chapters.ch03_dynamic_batching.step_loop import run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager
from chapters.ch08_continuous_batching.fast.cuda_graphs import GraphedDecodes, GraphedModelRunner, model_runner
from chapters.ch08_continuous_batching.model_runner import ModelRunner, packed_model
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence
from shared.settings import SettingsError

NO_CUDA = "recording CUDA graphs needs CUDA, and torch sees no GPU here"


def mixed_requests(n: int, seed: int, max_new: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(4, 100))], rng.randint(1, max_new)) for _ in range(n)]


def serve(model, store: PagedKVStore, capture: bool, requests, max_num_seqs: int = 8, budget: int = 64):
    """Every request through the scheduler and a runner whose decode-only steps go through GraphedDecodes."""
    attention = attention_here("flex", store)
    graphs = GraphedDecodes(model, store, attention, max_num_seqs, capture=capture)
    replayed = []
    run = graphs.run
    graphs.run = lambda bucket, rows: replayed.append(rows) or run(bucket, rows)
    scheduler = ContinuousScheduler(store, SchedulerConfig(max_num_seqs, budget, "grow"))
    seqs = [Sequence(p, n) for p, n in requests]
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, GraphedModelRunner(model, store, attention, graphs))
    # every block back but the scratch block that padding rows write to
    assert store.manager.free_blocks == store.manager.total_blocks - 1
    return seqs, scheduler, replayed


def test_the_static_decode_step_gives_the_oracles_tokens_under_chunked_prefill_and_preemption(default_model, oracle) -> None:
    requests = mixed_requests(12, seed=8, max_new=32)
    store = PagedKVStore(KVMemoryPool(default_model.config, 528, block_tokens=16))
    seqs, scheduler, replayed = serve(default_model.model, store, capture=False, requests=requests)
    for seq, (p, n) in zip(seqs, requests):
        assert seq.output_ids == oracle(p, n), f"prompt of {len(p)}, {n} new tokens, {seq.preemptions} preemptions"
    assert scheduler.stats.preemptions > 0
    assert replayed and any(rows < 8 for rows in replayed)  # decode-only steps went through it, padded ones among them


def test_the_setting_is_refused_in_one_line_where_it_cannot_hold_and_auto_is_off_there(default_model) -> None:
    store = PagedKVStore(KVMemoryPool(default_model.config, 256, block_tokens=16))
    for name in ("gather", "flex"):
        attention = attention_here(name, store)
        assert type(model_runner("auto", default_model.model, store, attention, 8)) is ModelRunner
        assert type(model_runner("off", default_model.model, store, attention, 8)) is ModelRunner
        with pytest.raises(SettingsError, match="needs the pool on a GPU and the flex attention backend"):
            model_runner("on", default_model.model, store, attention, 8)
    assert store.manager.free_blocks == store.manager.total_blocks  # a refusal reserves nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_recorded_decode_steps_give_the_oracles_tokens_at_fp32_on_the_gpu(default_model, oracle) -> None:
    requests = mixed_requests(24, seed=9, max_new=48)
    model = copy.deepcopy(default_model.model).to("cuda")
    store = PagedKVStore(KVMemoryPool(default_model.config, 1024, block_tokens=16, device=torch.device("cuda")))
    seqs, _, replayed = serve(model, store, capture=True, requests=requests, max_num_seqs=32, budget=128)
    assert replayed
    for seq, (p, n) in zip(seqs, requests):
        assert seq.output_ids == oracle(p, n), f"prompt of {len(p)}, {n} new tokens"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_recorded_decode_steps_at_bf16_agree_with_the_oracle_within_chapter_5s_tolerance(default_model, oracle) -> None:
    requests = mixed_requests(24, seed=10, max_new=48)
    model = packed_model(build_eager(copy.deepcopy(default_model.model).to("cuda"), "bf16"))
    store = PagedKVStore(KVMemoryPool(default_model.config, 1024, block_tokens=16, device=torch.device("cuda"), dtype=torch.bfloat16))
    seqs, _, _ = serve(model, store, capture=True, requests=requests, max_num_seqs=32, budget=128)
    same = total = 0
    for seq, (p, n) in zip(seqs, requests):
        expected = oracle(p, n)
        same += sum(a == b for a, b in zip(seq.output_ids, expected))
        total += len(expected)
    print(f"bf16 recorded decode steps: {same} of {total} greedy tokens equal to the fp32 oracle's ({same / total:.3f})")
    assert same / total >= MIN_TOKEN_AGREEMENT
