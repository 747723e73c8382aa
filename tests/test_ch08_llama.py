"""Chapter 8's paged KV cache and its attention backends under grouped-query attention (the Llama family).

The pool holds the key/value heads only (``config.kv_width`` numbers a token per layer), and each
backend maps query head ``h`` to key/value head ``h // (heads / kv_heads)`` where the keys lie.

FP32, through the scheduler and runner (concurrent mixed-length requests, chunked prefill,
preemption): exactly the oracle's greedy tokens, and every sampled position's logits within
:data:`FP32_LOGITS_BOUND` of the dense forward's. The logits are what catch a wrong head mapping on
``llama-tiny``: its random weights, tied to its embedding, make it repeat its last token whatever
attention returns, so its tokens alone would pass. SmolLM2 (9 query heads over 3), a trained model,
must give the oracle's tokens too. The C kernel alone: it writes the new key/value heads where
``gather`` does and attends as it does, for several groupings. A bf16 cache: every step's logits
within :data:`BF16_LOGITS_BOUND` of the dense fp32 forward's, the oracle's tokens forced so that no
flipped token changes what the steps compute.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from chapter_flags import attention_here
from chapters.ch03_dynamic_batching.step_loop import run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch08_continuous_batching.fast.attention_choice import build_attention, scattered_decode_inputs
from chapters.ch08_continuous_batching.model_runner import ModelRunner
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence
from shared.generation import reference_greedy
from shared.model import ModelConfig
from shared.weights import LoadedModel, load_model

BACKENDS = ["gather", "flex", "kernel"]
# The largest |logit difference| of a served step from the dense fp32 forward (no cache, no batching),
# as a fraction of that forward's logit spread (max - min over the vocabulary) at the same position.
# fp32: summation order only. bf16 cache under the fp32 engine: what llama-tiny measured over every
# backend, with room for another machine's summation order. Both far below what one query head
# reading another's keys gives.
FP32_LOGITS_BOUND = 1e-4
BF16_LOGITS_BOUND = 0.005


@pytest.fixture(scope="module")
def llama_tiny() -> LoadedModel:
    """The seeded random Llama: byte vocabulary, 4 query heads sharing 2 key/value heads, 2 layers."""
    return load_model("dummy", "llama-tiny")


def mixed_requests(n: int, seed: int, max_new: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(4, 120))], rng.randint(1, max_new)) for _ in range(n)]


class CheckedRunner(ModelRunner):
    """The runner, keeping each sampled row's logits beside the dense fp32 forward's at the same position
    (``pairs``), the texts being each prompt followed by the oracle's answer (``answers[prompt]``). With
    ``force``, it returns the oracle's tokens instead of its logits: the steps then compute exactly what
    the oracle's run computes, whatever a reduced precision would have sampled."""

    def __init__(self, model, store: PagedKVStore, attention, answers: dict[tuple, list[int]], force: bool) -> None:
        super().__init__(model, store, attention)
        self.answers, self.force, self.pairs = answers, force, []
        with torch.no_grad():
            self.dense = {prompt: model(torch.tensor([[*prompt, *answer]]))[0] for prompt, answer in answers.items()}

    def execute(self, rows, num_decodes: int) -> Tensor:
        logits = super().execute(rows, num_decodes)
        sampling = [(tuple(row.seq.prompt_ids), len(row.seq.token_ids) - 1) for row in rows if row.samples]
        self.pairs += [(ours, self.dense[prompt][p]) for ours, (prompt, p) in zip(logits, sampling)]
        if not self.force:
            return logits
        tokens = [self.answers[prompt][p + 1 - len(prompt)] for prompt, p in sampling]
        return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), logits.shape[1]).float()

    def logits_error(self) -> float:
        """The largest |logit difference| from the dense forward, as a fraction of its spread there."""
        return max(float((ours - dense).abs().max() / (dense.max() - dense.min())) for ours, dense in self.pairs)


def served(model, attention: str, requests, dtype: torch.dtype = torch.float32) -> tuple[ContinuousScheduler, CheckedRunner]:
    """``requests`` through chapter 8's scheduler and runner at once (blocks of 16, a pool small enough to preempt,
    a token budget small enough to chunk the longer prompts); every sequence must end with the oracle's tokens,
    sampled (fp32) or forced (a bf16 cache)."""
    answers = {tuple(prompt): reference_greedy(model, prompt, n) for prompt, n in requests}
    store = PagedKVStore(KVMemoryPool(model.config, 528, block_tokens=16, dtype=dtype))
    scheduler = ContinuousScheduler(store, SchedulerConfig(6, 48, "grow"))
    runner = CheckedRunner(model, store, attention_here(attention, store), answers, force=dtype != torch.float32)
    seqs = [Sequence(prompt, n) for prompt, n in requests]
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, runner)
    for seq, (prompt, n) in zip(seqs, requests):
        assert seq.output_ids == answers[tuple(prompt)], f"prompt of {len(prompt)}, {n} new tokens, {seq.preemptions} preemptions"
    assert len(runner.pairs) == sum(n for _, n in requests)
    assert scheduler.manager.free_blocks == scheduler.manager.total_blocks
    return scheduler, runner


def test_the_pool_holds_the_key_value_heads_only(llama_tiny) -> None:
    config = llama_tiny.config
    store = PagedKVStore(KVMemoryPool(config, 528, block_tokens=16))
    assert config.kv_heads == 2 < config.n_head == 4
    assert store.plane(0, 0).shape == (528, config.kv_width) == (528, 2 * config.head_dim)
    assert store.pool.storage.numel() * 4 == 528 * config.kv_bytes_per_token()


@pytest.mark.parametrize("attention", BACKENDS)
def test_concurrent_mixed_requests_on_a_grouped_query_llama_get_the_oracles_tokens_and_logits(llama_tiny, attention: str) -> None:
    scheduler, runner = served(llama_tiny.model, attention, mixed_requests(8, seed=6, max_new=40))
    assert runner.logits_error() <= FP32_LOGITS_BOUND
    assert scheduler.stats.preemptions > 0  # resumed sequences (chunks over a cached past) are checked too


@pytest.mark.parametrize("attention", BACKENDS)
def test_smollm2_serves_a_short_prompt_with_the_oracles_tokens(smollm2, attention: str) -> None:
    prompt = smollm2.tokenizer.encode("The capital of France is the city of")
    assert 6 <= len(prompt) <= 10
    _, runner = served(smollm2.model, attention, [(prompt, 6), (prompt[:4], 3)])
    assert runner.logits_error() <= FP32_LOGITS_BOUND


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (9, 3, 64), (4, 1, 48), (6, 3, 16)])
def test_the_kernel_maps_each_query_head_to_its_key_value_head_as_gather_does(cache_dtype, heads, kv_heads, head_dim) -> None:
    """Decode rows over scattered blocks, q, k, v as a fused projection leaves them (strided views of one
    (N, W + 2 W_kv) tensor): the kernel writes the new key/value heads exactly where ``gather`` writes them
    and attends as it does; given contiguous copies it takes its copying path to the same sums. Heads of
    64 numbers (a constant to the compiler), 48 and 16; groups of 2, 3 and 4 query heads, and of 2 with
    one key/value head shared by all."""
    config = ModelConfig(vocab_size=16, n_ctx=64, n_embd=heads * head_dim, n_layer=1, n_head=heads, family="llama",
                         n_kv_head=kv_heads)
    rows, rng = 5, random.Random(3)
    store = PagedKVStore(KVMemoryPool(config, 64 * 4, block_tokens=4, dtype=cache_dtype))
    for kv in (0, 1):
        store.plane(0, kv).copy_(torch.randn(store.plane(0, kv).shape))
    inputs, _ = scattered_decode_inputs(store, [rng.randint(1, 30) for _ in range(rows)], rng)
    fused = torch.randn(1, rows, config.n_embd + 2 * config.kv_width)
    q, k, v = (t.view(1, rows, -1, head_dim).transpose(1, 2) for t in fused.split([config.n_embd, config.kv_width, config.kv_width], dim=2))
    before = store.pool.storage.clone()
    expected = build_attention("gather", store).bind(inputs)(0, q, k, v)
    written, store.pool.storage[:] = store.pool.storage.clone(), before
    kernel = build_attention("kernel", store).bind(inputs)
    got = kernel(0, q, k, v)
    assert torch.equal(store.pool.storage, written)
    assert torch.allclose(got, expected, atol=2e-2 if cache_dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(kernel(0, *(t.contiguous() for t in (q, k, v))), got)


def test_the_kernel_rounds_new_keys_and_values_to_bf16_as_torch_does_ties_to_even() -> None:
    """Every new key and value exactly halfway between two bf16 numbers, half of them below an even one
    and half below an odd one: ties-to-even (torch's rounding, gather's) and half-up disagree on every
    second number, which random values almost never show."""
    config = ModelConfig(vocab_size=16, n_ctx=64, n_embd=4 * 16, n_layer=1, n_head=4, family="llama", n_kv_head=2)
    rows, rng = 4, random.Random(5)
    store = PagedKVStore(KVMemoryPool(config, 64 * 4, block_tokens=4, dtype=torch.bfloat16))
    inputs, _ = scattered_decode_inputs(store, [rng.randint(1, 20) for _ in range(rows)], rng)
    bits = torch.randn(1, rows, config.n_embd + 2 * config.kv_width).bfloat16().float().view(torch.int32)
    ties = (bits | 0x8000).view(torch.float32)  # the low half exactly 0x8000: a tie between two bf16 numbers
    assert {int(b) & 0x10000 for b in bits.flatten().tolist()} == {0, 0x10000}, "ties below even and odd numbers"
    q, k, v = (t.view(1, rows, -1, 16).transpose(1, 2) for t in ties.split([config.n_embd, config.kv_width, config.kv_width], dim=2))
    before = store.pool.storage.clone()
    build_attention("gather", store).bind(inputs)(0, q, k, v)
    written, store.pool.storage[:] = store.pool.storage.clone(), before
    build_attention("kernel", store).bind(inputs)(0, q, k, v)
    assert torch.equal(store.pool.storage.view(torch.int16), written.view(torch.int16))


# flex's compilation for the bf16 cache is most of its time: with make test-slow
@pytest.mark.parametrize("attention", ["gather", pytest.param("flex", marks=pytest.mark.slow), "kernel"])
def test_a_bf16_cache_keeps_every_steps_logits_within_the_measured_bound(llama_tiny, attention: str) -> None:
    _, runner = served(llama_tiny.model, attention, mixed_requests(6, seed=5, max_new=16), dtype=torch.bfloat16)
    error = runner.logits_error()
    assert 0 < error <= BF16_LOGITS_BOUND, f"{attention}: {error:.4f} of the logit spread"


def test_a_cast_engine_leaves_the_version_one_copy_of_the_weights(llama_tiny) -> None:
    """``--precision bf16`` serves a converted copy of the loaded model; the fp32 original must not stay
    alive beside it (the version keeps the weights it serves), or a served model costs its weights twice."""
    import gc
    import weakref

    from chapters.ch08_continuous_batching.server import ContinuousSettings, build_backend

    loaded = load_model("dummy", "llama-tiny")
    original = weakref.ref(loaded.model)
    settings = ContinuousSettings(weights="dummy", preset="llama-tiny", device="cpu", engine="eager", precision="bf16",
                                  attention="gather", pool_tokens=1024, max_num_seqs=4, max_num_batched_tokens=64)
    backend = build_backend(settings, loaded)
    gc.collect()
    assert original() is None, "the fp32 original is still referenced beside the bf16 copy"
    assert loaded.model.config == llama_tiny.config and backend.description["engine"]["precision"] == "bf16"
