"""Chapter 5's ``cudagraph`` engine: bucketing, padding, and the static-shape decode step against the oracle.

The step a CUDA graph records (:meth:`CudaGraphEngine._static_step`) is plain PyTorch over static
buffers, so on a CPU it runs uncaptured (``capture=False``) and must already give the oracle's
tokens: padded up to its bucket, attending over a whole length bucket of columns. The capture itself
needs CUDA: those tests skip with the reason where there is none, and run where there is.
"""

from __future__ import annotations

import pytest
import torch

from chapters.ch03_dynamic_batching.batched_generation import batched_greedy
from chapters.ch04_memory_pool.memory_pool import BatchCacheLease, KVMemoryPool
from chapters.ch05_inference_engine.cudagraph_engine import (
    DEFAULT_BATCH_BUCKETS,
    BatchTooLarge,
    CudaGraphEngine,
    StaticSlotCache,
    batch_buckets_for,
    bucket_for,
    build_cudagraph,
    length_buckets_for,
    static_shape_in,
)
from chapters.ch05_inference_engine.engine import EngineUnavailable
from chapters.ch05_inference_engine.engines import build_engine, unavailable_reason
from shared.model import DynamicKVCache
from shared.tokenizer import PAD_ID
from shared.weights import LoadedModel, load_model

CPU = torch.device("cpu")
NO_CUDA = "CUDA graphs need a CUDA device; this machine has none (the static step is tested uncaptured above)"

# Five prompts of different lengths: a batch of 5 pads up to the 8-row bucket and is left-padded.
PROMPTS = [list(b"12+34="), list(b"the old robot paints a "), list(b"t"), list(b"71+28=82\n55+17="), list(b"hello, ")]
NEW_TOKENS = [12, 5, 9, 12, 1]


def static_engine(loaded: LoadedModel, batch_buckets=(1, 2, 4, 8), max_len: int = 96) -> CudaGraphEngine:
    """The engine's static-shape decode, uncaptured, on the CPU; small buffers (max_len positions)."""
    return CudaGraphEngine(loaded.model, "fp32", capture=False, batch_buckets=batch_buckets,
                           length_buckets=(16, 32, 64), max_len=max_len)


def expected(oracle, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> list[list[int]]:
    return [oracle(p, n) for p, n in zip(prompts, new_tokens)]


# ---------------------------------------------------------------------------------------------
# Bucketing
# ---------------------------------------------------------------------------------------------


def test_a_batch_goes_to_the_smallest_bucket_that_holds_it() -> None:
    for rows in range(1, DEFAULT_BATCH_BUCKETS[-1] + 1):
        smallest = min(b for b in DEFAULT_BATCH_BUCKETS if b >= rows)  # the definition, by brute force
        assert bucket_for(rows, DEFAULT_BATCH_BUCKETS) == smallest


def test_a_batch_over_the_largest_bucket_is_refused_not_split() -> None:
    with pytest.raises(BatchTooLarge, match="256"):
        bucket_for(257, DEFAULT_BATCH_BUCKETS)
    with pytest.raises(ValueError):
        bucket_for(0, DEFAULT_BATCH_BUCKETS)


def test_length_buckets_always_end_at_the_static_length() -> None:
    assert length_buckets_for(1024) == (64, 128, 256, 512, 1024)
    assert length_buckets_for(300) == (64, 128, 256, 300)
    assert length_buckets_for(10) == (10,)


def test_batch_buckets_always_end_at_the_largest_batch() -> None:
    assert batch_buckets_for(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets_for(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets_for(1) == (1,)


def test_the_static_shape_in_a_pool_is_the_largest_batch_at_the_whole_context_or_the_rows_that_fit(default_model: LoadedModel) -> None:
    n_ctx = default_model.config.n_ctx
    roomy = KVMemoryPool(default_model.config, 10 * n_ctx, device=CPU)
    assert static_shape_in(roomy, 8) == ((1, 2, 4, 8), n_ctx)
    assert static_shape_in(KVMemoryPool(default_model.config, 3 * n_ctx + 5, device=CPU), 8) == ((1, 2, 3), n_ctx)
    with pytest.raises(ValueError, match="one sequence"):
        static_shape_in(KVMemoryPool(default_model.config, n_ctx - 16, device=CPU), 8)


def test_the_engine_refuses_more_rows_than_its_largest_bucket(default_model: LoadedModel) -> None:
    engine = static_engine(default_model, batch_buckets=(1, 2))
    with pytest.raises(BatchTooLarge):
        engine.new_cache(3, 16)
    cache = DynamicKVCache(engine.config.n_layer)
    ids = torch.tensor([list(b"ab")] * 3)
    engine.prefill(ids, None, None, cache)
    with pytest.raises(BatchTooLarge):
        engine.decode(ids[:, -1:], None, None, cache)


# ---------------------------------------------------------------------------------------------
# The static step, uncaptured, against the oracle
# ---------------------------------------------------------------------------------------------


def test_static_decode_in_its_own_cache_gives_the_oracles_tokens(default_model: LoadedModel, oracle) -> None:
    """Chapter 3's step loop with the engine's own cache (no copies): 5 rows padded to the 8-row bucket."""
    engine = static_engine(default_model)
    rows = batched_greedy(engine, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=engine.new_cache)
    assert [r.output_ids for r in rows] == expected(oracle)
    # Every decode step went through the static step (none fell back to the eager model).
    assert engine.stats["uncaptured_static_steps"] == max(NEW_TOKENS) - 1
    assert engine.stats["eager_steps"] == 0 and engine.stats["adoptions"] == 0


def test_static_decode_adopts_any_other_cache_once_per_batch(default_model: LoadedModel, oracle) -> None:
    """The growing cache (chapter 3's default) and chapter 4's pool: copied in at the first decode step only."""
    engine = static_engine(default_model)
    rows = batched_greedy(engine, PROMPTS, NEW_TOKENS, PAD_ID)
    assert [r.output_ids for r in rows] == expected(oracle)
    assert engine.stats["adoptions"] == 1

    pool = KVMemoryPool(engine.config, 4096, device=CPU, dtype=engine.dtype)
    with BatchCacheLease(pool) as lease:
        rows = batched_greedy(engine, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=lease.new_cache)
    assert [r.output_ids for r in rows] == expected(oracle)
    assert engine.stats["adoptions"] == 2


def test_the_foreign_cache_holds_every_decoded_position(default_model: LoadedModel) -> None:
    """The KVCache protocol: after decode the cache holds the new token's keys, equal to the eager model's."""
    engine = static_engine(default_model)
    ids = torch.tensor([list(b"12+34="), list(b"56+78=")])
    ours, theirs = DynamicKVCache(engine.config.n_layer), DynamicKVCache(engine.config.n_layer)
    engine.prefill(ids, None, None, ours)
    next_ids = default_model.model.prefill(ids, None, None, theirs).argmax(-1, keepdim=True)
    ours_logits = engine.decode(next_ids, None, None, ours)
    theirs_logits = default_model.model.decode(next_ids, None, None, theirs)
    assert ours.seq_len == theirs.seq_len == 7
    for layer in range(engine.config.n_layer):
        torch.testing.assert_close(ours.read(layer)[0], theirs.read(layer)[0])
        torch.testing.assert_close(ours.read(layer)[1], theirs.read(layer)[1])
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=1e-4, atol=1e-4)


def test_padding_rows_never_change_real_rows(default_model: LoadedModel, oracle) -> None:
    """The same 5 rows in a 5-row bucket (no padding) and an 8-row one whose 3 padding rows are poisoned
    with NaN, and with garbage in every column past the sequence: the same tokens, the oracle's."""
    unpadded = static_engine(default_model, batch_buckets=(5,))
    padded = static_engine(default_model, batch_buckets=(8,))
    for layer in range(padded.config.n_layer):
        for buffer in (padded.static_keys[layer], padded.static_values[layer]):
            buffer.fill_(1e4)  # stale keys and values of an earlier, longer batch: must stay masked
            buffer[len(PROMPTS):] = float("nan")  # padding rows: must never reach a real row
    with_padding = batched_greedy(padded, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=padded.new_cache)
    without = batched_greedy(unpadded, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=unpadded.new_cache)
    assert [r.output_ids for r in with_padding] == [r.output_ids for r in without] == expected(oracle)


def test_one_engine_serves_batches_of_every_bucket_in_turn(default_model: LoadedModel, oracle) -> None:
    """Consecutive batches of 1, 2, 3 and 8 rows (buckets 1, 2, 4, 8) on the same static buffers."""
    engine = static_engine(default_model)
    prompts = PROMPTS + [list(b"99+1="), list(b"a"), list(b"the clever fox ")]
    for size in (8, 1, 3, 2):  # the longest first: later batches run over its stale keys
        batch, new = prompts[:size], [6] * size
        rows = batched_greedy(engine, batch, new, PAD_ID, cache_factory=engine.new_cache)
        assert [r.output_ids for r in rows] == expected(oracle, batch, new), f"batch of {size}"


def test_a_closed_cache_cannot_be_used(default_model: LoadedModel) -> None:
    engine = static_engine(default_model)
    first = engine.new_cache(2, 16)
    engine.new_cache(2, 16)  # the static rows belong to the new batch now
    with pytest.raises(RuntimeError, match="closed"):
        first.update(0, torch.zeros(2, engine.config.n_head, 1, engine.config.head_dim),
                     torch.zeros(2, engine.config.n_head, 1, engine.config.head_dim))


def test_a_sequence_past_the_static_length_is_refused(default_model: LoadedModel) -> None:
    engine = static_engine(default_model, max_len=16)
    with pytest.raises(ValueError, match="static length"):
        engine.new_cache(1, 17)
    cache = DynamicKVCache(engine.config.n_layer)
    ids = torch.tensor([list(range(16))])
    engine.prefill(ids, None, None, cache)
    with pytest.raises(ValueError, match="static length"):
        engine.decode(ids[:, -1:], None, None, cache)


def test_static_cache_is_one_range_of_a_chapter_4_pool(default_model: LoadedModel) -> None:
    pool = KVMemoryPool(default_model.config, 8 * 64 + 64, block_tokens=64, device=CPU)
    engine = CudaGraphEngine(default_model.model, "fp32", capture=False, batch_buckets=(1, 8), max_len=64, pool=pool)
    assert pool.stats().blocks_used == 8  # 8 rows x 64 positions, taken once
    keys = engine.static_keys[0]
    assert keys.shape == (8, default_model.config.n_head, 64, default_model.config.head_dim)
    assert keys.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()
    assert isinstance(engine.new_cache(3, 10), StaticSlotCache)
    engine.close()
    assert pool.stats().blocks_used == 0


# ---------------------------------------------------------------------------------------------
# Capture: CUDA only, never faked
# ---------------------------------------------------------------------------------------------


def test_without_cuda_the_engine_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the engine can be built here")
    reason = unavailable_reason("cudagraph", "fp32", CPU)
    assert reason is not None and "CUDA" in reason
    with pytest.raises(EngineUnavailable, match="CUDA"):
        build_engine(load_model("default").model, "cudagraph", "fp32")
    with pytest.raises(EngineUnavailable):
        CudaGraphEngine(load_model("default").model, "fp32", capture=True, batch_buckets=(1,), max_len=16)


@pytest.fixture(scope="module")
def cuda_model() -> LoadedModel:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return load_model("default", device="cuda")


def test_captured_graphs_give_the_oracles_tokens(cuda_model: LoadedModel, oracle) -> None:
    """fp32 on CUDA: the replayed graphs, through the engine's own cache and through a pool cache."""
    engine = build_cudagraph(cuda_model.model, "fp32", batch_buckets=(1, 2, 4, 8), length_buckets=(32, 64), max_len=96)
    rows = batched_greedy(engine, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=engine.new_cache)
    assert engine.stats["graph_replays"] == max(NEW_TOKENS) - 1 and engine.stats["uncaptured_static_steps"] == 0
    mismatches = [i for i, (r, e) in enumerate(zip(rows, expected(oracle))) if r.output_ids != e]
    assert not mismatches, f"rows {mismatches} differ from the oracle (GPU kernels may reorder sums: measure agreement)"
    pool = KVMemoryPool(engine.config, 4096, device=engine.device, dtype=engine.dtype)
    with BatchCacheLease(pool) as lease:
        pooled = batched_greedy(engine, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=lease.new_cache)
    assert [r.output_ids for r in pooled] == [r.output_ids for r in rows]


def test_captured_and_uncaptured_steps_agree(cuda_model: LoadedModel) -> None:
    """The graph replays what the static step computes: same inputs, the same logits."""
    kwargs = {"batch_buckets": (8,), "length_buckets": (32,), "max_len": 32}
    captured = build_cudagraph(cuda_model.model, "fp32", **kwargs)
    direct = CudaGraphEngine(cuda_model.model, "fp32", capture=False, **kwargs)
    outputs = []
    for engine in (captured, direct):
        cache = engine.new_cache(5, 32)
        ids = torch.tensor([list(b"abcdef")] * 5, device="cuda")
        engine.prefill(ids, None, None, cache)
        outputs.append(engine.decode(ids[:, -1:], None, None, cache))
    torch.testing.assert_close(outputs[0], outputs[1])


def test_reduced_precision_graphs_run(cuda_model: LoadedModel) -> None:
    engine = build_cudagraph(cuda_model.model, "fp16", batch_buckets=(1, 8), length_buckets=(64,), max_len=64)
    rows = batched_greedy(engine, PROMPTS, NEW_TOKENS, PAD_ID, cache_factory=engine.new_cache)
    assert [len(r.output_ids) for r in rows] == NEW_TOKENS
    assert engine.dtype == torch.float16 and engine.static_keys[0].dtype == torch.float16
