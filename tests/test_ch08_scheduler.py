"""Chapter 8's continuous-batching scheduler on chapter 3's step loop.

Units drive it with a fake model whose next token is a known function of the whole sequence, read
back through the paged cache (so a wrong block table, offset or mask gives a wrong token): admission
under both budgets, chunked prefill offsets, preemption and resume. Then the real default model in
FP32 must return exactly the oracle's tokens for concurrent mixed requests, under both KV policies.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_ch08_block_manager import assert_consistent
from torch import Tensor

from chapter_flags import attention_here
from chapters.ch03_dynamic_batching.step_loop import run_step, run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager, multiplies_in_bf16
from chapters.ch05_inference_engine.engines import ACCURACY_TOLERANCE, PROBE_PAIRS
from chapters.ch08_continuous_batching.fast.attention_choice import build_attention
from chapters.ch08_continuous_batching.model_runner import ModelRunner, packed_model
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence, Status
from shared.corpus import HELD_OUT_PAIRS, evaluate, reversed_sum
from shared.model import ModelConfig
from shared.tokenizer import ByteTokenizer

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


class FakePackedModel:
    """Stores each token id as its value and reads the values back through the paged attention backend.

    Queries and keys are zero, so attention weighs every visible position equally: the output is the
    mean token id of the positions 0 .. p each token may see, times p + 1, their sum. A wrong slot
    mapping, block table, context length or mask gives a wrong sum, hence a wrong token.
    Records each call (the positions it computed, each sequence's query length, the decode rows).
    """

    config = FAKE_CONFIG

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def forward_packed(self, input_ids: Tensor, position_ids: Tensor, attend, logits_indices: Tensor) -> Tensor:
        n = input_ids.shape[0]
        value = torch.stack([input_ids.double(), torch.ones(n, dtype=torch.double)], dim=-1).float()[None, None]  # (1, 1, N, 2)
        zeros = torch.zeros_like(value)
        mean = attend(0, zeros, zeros.clone(), value)[0, 0, :, 0]  # (N,)
        count = position_ids + 1
        total = (mean.double() * count).round().long()
        next_ids = (total * 31 + count * 7) % FAKE_CONFIG.vocab_size
        self.calls.append({"positions": position_ids.tolist(), "logits_indices": logits_indices.tolist()})
        return torch.nn.functional.one_hot(next_ids[logits_indices], FAKE_CONFIG.vocab_size).float()


class FakeRunner(ModelRunner):
    """Chapter 8's model runner (packing, slot mapping, attention backend) around :class:`FakePackedModel`."""

    def execute(self, rows, num_decodes: int) -> Tensor:
        self.model.calls.append({"query_lens": [len(r.new_ids) for r in rows], "decodes": num_decodes})
        logits = super().execute(rows, num_decodes)
        packed = self.model.calls.pop()
        self.model.calls[-1].update(packed)
        return logits

    @property
    def calls(self) -> list[dict]:
        return self.model.calls


def fake_setup(max_num_seqs: int, budget: int, policy: str = "grow", blocks: int = 16, block_tokens: int = 4,
               attention: str = "gather", dtype: torch.dtype = torch.float32) -> tuple[ContinuousScheduler, FakeRunner]:
    pool = KVMemoryPool(FAKE_CONFIG, blocks * block_tokens, block_tokens=block_tokens, dtype=dtype)
    store = PagedKVStore(pool)
    scheduler = ContinuousScheduler(store, SchedulerConfig(max_num_seqs, budget, policy))
    return scheduler, FakeRunner(FakePackedModel(), store, attention_here(attention, store))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PAD) for _ in range(n)]


def run_and_check(scheduler: ContinuousScheduler, model: FakeRunner, seqs: list[Sequence]) -> None:
    for seq in seqs:
        scheduler.add(seq)
    while run_step(scheduler, model):
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        assert_consistent(scheduler.manager)
    for seq in seqs:
        assert seq.status is Status.FINISHED
        assert seq.output_ids == fake_oracle(seq.prompt_ids, seq.max_new_tokens)
    assert scheduler.manager.free_blocks == scheduler.manager.total_blocks


@pytest.mark.exercise("ch08.2")
def test_admission_stops_at_max_num_seqs_and_a_finished_sequence_frees_its_row_at_once() -> None:
    scheduler, model = fake_setup(max_num_seqs=2, budget=64)
    short, long_, third = Sequence(prompt(3, 1), 1), Sequence(prompt(3, 2), 5), Sequence(prompt(3, 3), 2)
    for seq in (short, long_, third):
        scheduler.add(seq)
    run_step(scheduler, model)  # admits two; `short` is done after its prompt pass
    assert short.status is Status.FINISHED and list(scheduler.running) == [long_] and list(scheduler.waiting) == [third]
    run_step(scheduler, model)  # `third` joins while `long_` decodes: no waiting for the batch's end
    assert scheduler.running == [long_, third]
    # ONE packed call: long_'s decode, then third's whole prompt; logits for both (both sample)
    assert model.calls[-1]["query_lens"] == [1, 3] and model.calls[-1]["decodes"] == 1
    assert model.calls[-1]["logits_indices"] == [0, 3]
    run_and_check(scheduler, model, [])
    assert long_.output_ids == fake_oracle(long_.prompt_ids, 5)


@pytest.mark.exercise("ch08.2")
def test_the_token_budget_chunks_prompts_at_the_right_offsets() -> None:
    scheduler, model = fake_setup(max_num_seqs=4, budget=16)
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
    scheduler, model = fake_setup(max_num_seqs=2, budget=16)
    seq = Sequence(prompt(40, 7), 2)
    scheduler.add(seq)
    run_until_done(scheduler, model)
    # (the position of each call's first new token: the positions already cached, whatever the layout)
    assert [(c["positions"][0], len(c["positions"])) for c in model.calls] == [(0, 16), (16, 16), (32, 8), (40, 1)]
    assert model.calls[1]["positions"] == list(range(16, 32))
    assert [c["logits_indices"] for c in model.calls] == [[], [], [7], [0]]  # logits only where a token is sampled
    assert seq.output_ids == fake_oracle(seq.prompt_ids, 2)


@pytest.mark.exercise("ch08.3")
def test_grow_preempts_the_newest_by_recompute_and_every_sequence_still_gets_the_oracles_tokens() -> None:
    # 16 blocks of 4 tokens; three sequences that each reach 39 positions (10 blocks) cannot all stay.
    scheduler, model = fake_setup(max_num_seqs=3, budget=64, policy="grow")
    seqs = [Sequence(prompt(20, 10 + i), 20) for i in range(3)]
    run_and_check(scheduler, model, seqs)
    assert scheduler.stats.preemptions > 0
    assert seqs[0].preemptions == 0  # the oldest is never the victim
    assert any(s.preemptions for s in seqs[1:])


@pytest.mark.exercise("ch08.2")
def test_reserve_admits_only_what_fits_whole_and_never_preempts() -> None:
    scheduler, model = fake_setup(max_num_seqs=3, budget=64, policy="reserve")
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
    scheduler, model = fake_setup(max_num_seqs=4, budget=64)
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


def real_setup(default_model, policy: str, pool_tokens: int, max_num_seqs: int = 16, budget: int = 128,
               attention: str = "gather", block_tokens: int = 16) -> tuple[ContinuousScheduler, ModelRunner]:
    pool = KVMemoryPool(default_model.config, pool_tokens, block_tokens=block_tokens)
    store = PagedKVStore(pool)
    scheduler = ContinuousScheduler(store, SchedulerConfig(max_num_seqs, budget, policy))
    return scheduler, ModelRunner(default_model.model, store, attention_here(attention, store))


def check_against_oracle(default_model, oracle, setup: tuple[ContinuousScheduler, ModelRunner], requests) -> None:
    scheduler, runner = setup
    seqs = [Sequence(p, n) for p, n in requests]
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, runner)
    for seq, (p, n) in zip(seqs, requests):
        assert seq.output_ids == oracle(p, n), f"prompt of {len(p)}, {n} new tokens, {seq.preemptions} preemptions"
    assert scheduler.manager.free_blocks == scheduler.manager.total_blocks


@pytest.mark.parametrize(("policy", "pool_tokens"), [("grow", 528), ("reserve", 4096)])
@pytest.mark.exercise("ch08.2")
def test_concurrent_mixed_requests_get_the_oracles_tokens(default_model, oracle, policy: str, pool_tokens: int) -> None:
    scheduler, runner = real_setup(default_model, policy, pool_tokens, max_num_seqs=8, budget=64)
    check_against_oracle(default_model, oracle, (scheduler, runner), mixed_requests(12, seed=8, max_new=32))
    if policy == "grow":
        assert scheduler.stats.preemptions > 0  # the small pool forced some: resumed ones are checked too


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "pool_tokens"), [("grow", 1024), ("reserve", 8192)])
def test_64_concurrent_mixed_requests_get_the_oracles_tokens(default_model, oracle, policy: str, pool_tokens: int) -> None:
    check_against_oracle(default_model, oracle, real_setup(default_model, policy, pool_tokens, max_num_seqs=32, budget=256),
                         mixed_requests(64, seed=64, max_new=64))


@pytest.mark.parametrize("attention", ["gather", "flex", "kernel"])
def test_every_attention_backend_reads_the_paged_cache_right_through_the_fake_model(attention: str) -> None:
    # scattered tables, chunked prefill beside decodes, preemption: the fake model's sums see every slot
    scheduler, model = fake_setup(max_num_seqs=3, budget=8, blocks=16, block_tokens=4, attention=attention)
    seqs = [Sequence(prompt(n, 200 + n), 20) for n in (5, 11, 17)]
    run_and_check(scheduler, model, seqs)
    assert scheduler.stats.preemptions > 0


@pytest.mark.parametrize("attention", ["flex", "kernel"])
def test_the_in_place_backends_give_the_oracles_tokens_under_chunked_prefill_and_preemption(default_model, oracle, attention: str) -> None:
    scheduler, runner = real_setup(default_model, "grow", 528, max_num_seqs=8, budget=64, attention=attention)
    check_against_oracle(default_model, oracle, (scheduler, runner), mixed_requests(12, seed=8, max_new=32))
    assert scheduler.stats.preemptions > 0


# gather over blocks of 128 pads every row to whole large blocks, the slowest case of the fast suite: it runs with make
# test-slow, while the kernel runs the server's block here and gather keeps its own tests on smaller blocks.
@pytest.mark.parametrize("attention", [pytest.param("gather", marks=pytest.mark.slow), "kernel"])
def test_the_servers_blocks_of_128_give_the_oracles_tokens_under_chunked_prefill_and_preemption(default_model, oracle, attention: str) -> None:
    # the server's default block: a prompt chunk and a history then share one block, and a preempted
    # sequence gives back a few large blocks
    scheduler, runner = real_setup(default_model, "grow", 512, max_num_seqs=8, budget=64, attention=attention, block_tokens=128)
    check_against_oracle(default_model, oracle, (scheduler, runner), mixed_requests(8, seed=8, max_new=160))
    assert scheduler.stats.preemptions > 0


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_embd, n_head, n_kv_head", [(32, 2, 2), (128, 2, 2), (96, 2, 2), (288, 1, 1), (576, 9, 3), (320, 5, 1)])
def test_the_kernel_reads_the_models_own_views_and_writes_the_new_keys_where_gather_does(cache_dtype, n_embd, n_head, n_kv_head) -> None:
    """Decode rows over scattered blocks: the kernel, given q, k, v as the model's ``c_attn`` leaves them
    (strided views of one (N, 3W) tensor), writes the pool exactly as ``gather`` does and attends as it
    does; given contiguous copies or bf16 inputs it takes its copying path to the same result. Heads of
    16, 64, 48 and 288 numbers: one number at a time, in vector pairs (GPT-2's 64, a constant to the
    compiler), both, and more than the registers hold; and grouped-query attention: SmolLM2's 9 query heads
    over 3 key/value heads (a group attended together), and a group of 5 (more than the kernel takes at once)."""
    from chapters.ch08_continuous_batching.fast.attention_choice import scattered_decode_inputs

    config = ModelConfig(vocab_size=16, n_ctx=64, n_embd=n_embd, n_layer=1, n_head=n_head, n_kv_head=n_kv_head)
    rows, size, rng = 5, 4, random.Random(3)
    store = PagedKVStore(KVMemoryPool(config, 64 * 4, block_tokens=size, dtype=cache_dtype))
    for kv in (0, 1):
        store.plane(0, kv).copy_(torch.randn(store.plane(0, kv).shape))
    inputs, _ = scattered_decode_inputs(store, [rng.randint(1, 30) for _ in range(rows)], rng)
    fused = torch.randn(1, rows, config.n_embd + 2 * config.kv_width)  # what the fused projection returns, viewed as the model does
    q, k, v = (t.view(1, rows, heads, -1).transpose(1, 2)
               for t, heads in zip(fused.split([config.n_embd, config.kv_width, config.kv_width], dim=2), (n_head, n_kv_head, n_kv_head)))
    before = store.pool.storage.clone()
    expected = build_attention("gather", store).bind(inputs)(0, q, k, v)
    written, store.pool.storage[:] = store.pool.storage.clone(), before
    kernel = build_attention("kernel", store).bind(inputs)
    got = kernel(0, q, k, v)
    assert torch.equal(store.pool.storage, written)  # the new keys and values, rounded as PyTorch rounds
    assert torch.allclose(got, expected, atol=2e-2 if cache_dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(kernel(0, *(t.contiguous() for t in (q, k, v))), got)  # the copying path: the same sums
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert torch.equal(kernel(0, *low), kernel(0, *(t.float() for t in low)).to(torch.bfloat16))


def test_the_studies_that_rebuild_the_kernel_still_find_what_they_change_in_its_source() -> None:
    """The kernel-floor study takes the arithmetic out of ``paged_decode.c`` by replacing lines of it, and the
    prefetch and eviction studies change its prefetch: a rewrite of the kernel must keep them measuring it."""
    import importlib.util

    from chapters.ch08_continuous_batching.fast.attention_kernel import KERNEL_SOURCE

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "studies" / "kernel_floor" / "floor_study.py"
    spec = importlib.util.spec_from_file_location("floor_study", path)
    floor_study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floor_study)
    source = floor_study.reads_only_source()  # asserts each line it replaces is there
    assert source != KERNEL_SOURCE.read_text() and "exp_lanes(lanes_fp32" not in source
    kernel = KERNEL_SOURCE.read_text()
    assert "__builtin_prefetch((const char *)row + at, 0, 3)" in kernel and "#define AHEAD 8" in kernel  # hints_study's


def test_the_studies_find_the_kernel_of_a_git_revision() -> None:
    """``--kernel-of REV`` (the floor and step-split studies) reads ``paged_decode.c`` from git where the chapter keeps it."""
    from benchmarks.studies.ch08_shared_prefix.step_split import kernel_source_at

    assert "PAGED_DECODE(paged_decode_bf16" in kernel_source_at("HEAD")


def test_the_kernel_backend_says_why_it_cannot_run_without_a_compiler_or_when_the_build_fails(tmp_path) -> None:
    from chapters.ch08_continuous_batching.fast.attention_kernel import KernelUnavailable, build_kernel

    with pytest.raises(KernelUnavailable, match="C compiler"):
        build_kernel(compiler=str(tmp_path / "no-such-cc"), cache=tmp_path)
    with pytest.raises(KernelUnavailable, match="paged_decode.c with .*false failed"):
        build_kernel(compiler="false", cache=tmp_path)  # a "compiler" that exits 1
    assert not list(tmp_path.iterdir())  # nothing half-built left behind
    library = build_kernel(cache=tmp_path)  # the machine's own: built, then found
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"] and library.paged_decode_bf16 is not None


def test_the_attention_rule_times_the_backends_in_turns_and_serves_the_fastest_only_past_its_margin(monkeypatch, tmp_path) -> None:
    from chapters.ch08_continuous_batching.fast import attention_choice

    scheduler, runner = fake_setup(max_num_seqs=4, budget=16, blocks=64)
    store, order = runner.store, []

    def recording(label: str) -> type:
        class Recording(attention_choice.GatherAttention):
            def bind(self, inputs):
                order.append(label)
                return super().bind(inputs)
        Recording.__name__ = f"Recording_{label}"
        return Recording

    backends = {"a": recording("a")(store), "b": recording("b")(store)}
    timings = attention_choice.measure_decode_steps(runner.model, store, backends, sequences=2, rounds=3)
    assert order == ["a", "b"] * 2 + ["a", "b", "b", "a", "a", "b"]  # two unmeasured steps each, then three rounds taking turns
    assert set(timings) == {"a", "b"} and store.manager.free_blocks == store.manager.total_blocks

    class FailsToCompile(attention_choice.GatherAttention):
        def bind(self, inputs):
            raise RuntimeError("C++ compile error\n(the compiler's whole output)")

    with_failing = {"gather": attention_choice.GatherAttention(store), "flex": FailsToCompile(store)}
    with pytest.raises(RuntimeError):  # named by the user, or by the warm-up: its failure is the start's
        attention_choice.measure_decode_steps(runner.model, store, with_failing, sequences=2, rounds=1)
    assert store.manager.free_blocks == store.manager.total_blocks
    timings = attention_choice.measure_decode_steps(runner.model, store, with_failing, sequences=2, rounds=1,
                                                    leave_out_failing=True)
    assert set(timings) == {"gather"} and store.manager.free_blocks == store.manager.total_blocks

    class Broken(attention_choice.GatherAttention):
        def __init__(self, store):
            raise ValueError("not on this pool")

    monkeypatch.setattr(attention_choice, "BACKENDS", {"gather": attention_choice.GatherAttention, "near": recording("near"),
                                                      "fast": recording("fast"), "broken": Broken})
    monkeypatch.setenv("SFS_CACHE_DIR", str(tmp_path))  # the rule's cached choice: this test's own
    measured = {}
    monkeypatch.setattr(attention_choice, "measure_decode_steps", lambda model, store, candidates, rows, **_: measured[frozenset(candidates)])
    measured[frozenset({"gather", "near", "fast"})] = {"gather": [1.0], "near": [0.95], "fast": [0.5]}
    assert type(attention_choice._by_the_rule(store, runner.model, 4, remeasure=True)).__name__ == "Recording_fast"  # 2x gather
    measured[frozenset({"gather", "near", "fast"})] = {"gather": [1.0], "near": [0.95], "fast": [0.93]}
    assert type(attention_choice._by_the_rule(store, runner.model, 4, remeasure=True)) is attention_choice.GatherAttention  # within 10 %


def addition_accuracy(model, store: PagedKVStore, attention: str, pairs: list[tuple[int, int]]) -> float:
    """Exact-match accuracy of the held-out additions (:func:`shared.corpus.evaluate`'s task) served by
    chapter 8's step loop: four greedy tokens per prompt, every decode reading the paged cache."""
    scheduler = ContinuousScheduler(store, SchedulerConfig(64, 512, "grow"))
    runner = ModelRunner(model, store, attention_here(attention, store))
    tokenizer = ByteTokenizer()
    seqs = [Sequence(tokenizer.encode(f"{a}+{b}="), 4) for a, b in pairs]
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, runner)
    assert scheduler.manager.free_blocks == scheduler.manager.total_blocks
    answers = [tokenizer.decode(seq.output_ids).split("\n", 1)[0] for seq in seqs]
    return sum(answer == reversed_sum(a, b) for answer, (a, b) in zip(answers, pairs)) / len(pairs)


# flex's compilation for the bf16 cache is most of this test's time: with make test-slow
@pytest.mark.parametrize("attention", ["gather", pytest.param("flex", marks=pytest.mark.slow), "kernel"])
def test_a_bf16_kv_cache_under_the_bf16_engine_keeps_the_task_accuracy_within_chapter_5s_tolerance(default_model, attention: str) -> None:
    # the oracle is the fp32 model's own score on the task (shared.corpus.evaluate), not chapter 8's
    pairs = HELD_OUT_PAIRS[:PROBE_PAIRS]
    reference = evaluate(default_model.model, pairs).accuracy
    engine = build_eager(default_model.model, "bf16")
    # the cache the rule gives this engine where it multiplies in bf16 (elsewhere it computes as fp32: the next test)
    store = PagedKVStore(KVMemoryPool(default_model.config, 4096, block_tokens=16, dtype=torch.bfloat16))
    served = addition_accuracy(packed_model(engine), store, attention, pairs)
    assert served >= reference - ACCURACY_TOLERANCE, f"bf16 engine + bf16 cache {served:.3f} against fp32 {reference:.3f}"


def test_a_bf16_kv_cache_under_the_fp32_engine_keeps_the_task_accuracy_within_chapter_5s_tolerance(default_model) -> None:
    # --kv-cache-dtype bf16 beside an fp32 engine (not the default: its tokens are no longer the oracle's)
    # halves the bytes the decode attention reads; what it may cost is chapter 5's tolerance, no more
    pairs = HELD_OUT_PAIRS[:PROBE_PAIRS]
    reference = evaluate(default_model.model, pairs).accuracy
    engine = build_eager(default_model.model, "fp32")
    store = PagedKVStore(KVMemoryPool(default_model.config, 4096, block_tokens=16,
                                      dtype=kv_cache_dtype("bf16", multiplies_in_bf16(engine), engine.dtype)))
    served = addition_accuracy(packed_model(engine), store, "kernel", pairs)
    assert served >= reference - ACCURACY_TOLERANCE, f"fp32 engine + bf16 cache {served:.3f} against fp32 {reference:.3f}"


def test_the_kv_cache_dtype_rule_follows_what_the_engine_multiplies_in() -> None:
    assert kv_cache_dtype("auto", True, torch.float32) == torch.bfloat16  # the CPU's bf16 engine: fp32 activations, bf16 products
    # fp32 products (fp32 engines, and a bf16 engine on a CPU where bf16 lost at every size) keep an exact cache
    assert kv_cache_dtype("auto", False, torch.float32) == torch.float32
    assert kv_cache_dtype("auto", False, torch.float16) == torch.float16  # a GPU's fp16 engine: its activations' dtype
    assert kv_cache_dtype("fp32", True, torch.float32) == torch.float32
    assert kv_cache_dtype("bf16", False, torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        kv_cache_dtype("fp8", False, torch.float32)
