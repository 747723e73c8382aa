"""Chapter 8's compiled layers (compiled_layers.py): the same halves, computed by TorchInductor's fused loops.

The oracle for a compiled half is the eager half it replaces (same weights, same inputs); for the served
behaviour, chapter 5's task accuracy at bf16 within its tolerance of fp32's, as for the bf16 engine itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_ch08_scheduler import addition_accuracy

from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager, multiplies_in_bf16
from chapters.ch05_inference_engine.engines import ACCURACY_TOLERANCE, PROBE_PAIRS
from chapters.ch08_continuous_batching.compiled_layers import compile_layers, compile_layers_here
from chapters.ch08_continuous_batching.model_runner import packed_model
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from shared.corpus import HELD_OUT_PAIRS, evaluate


@pytest.fixture(autouse=True)
def freezing_restored():
    """compile_layers sets TorchInductor's freezing for its process; other tests here compile without it."""
    import torch._inductor.config

    before = torch._inductor.config.freezing
    yield
    torch._inductor.config.freezing = before


def test_the_rule_compiles_under_bf16_products_on_a_cpu_and_never_at_fp32_unless_asked(default_model) -> None:
    fp32, bf16 = build_eager(default_model.model, "fp32"), build_eager(copy.deepcopy(default_model.model), "bf16")
    assert not compile_layers_here("auto", fp32)  # the oracle's exact tokens stay the fp32 promise
    assert compile_layers_here("on", fp32) and not compile_layers_here("off", bf16)
    assert compile_layers_here("auto", bf16) == multiplies_in_bf16(bf16)  # where this CPU's bf16 products pay


def test_each_compiled_half_computes_what_the_eager_half_computes(default_model) -> None:
    eager = default_model.model
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    config, generator = eager.config, torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in (1, 3, 37):  # one token, a few, more: each compiled variant, and a count none was warmed with
            x = torch.randn(1, tokens, config.n_embd, generator=generator)
            # attention's output as a backend leaves it: (1, H, T, D), here a transposed view
            y = torch.randn(1, tokens, config.n_head, config.head_dim, generator=generator).transpose(1, 2)
            for ours, theirs in zip(compiled.h, eager.h):
                torch.testing.assert_close(ours.qkv(x), theirs.qkv(x), rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(ours.after_attention(x, y), theirs.after_attention(x, y), rtol=1e-4, atol=1e-4)


def test_the_bf16_engine_with_compiled_layers_keeps_the_task_accuracy_within_chapter_5s_tolerance(default_model) -> None:
    pairs = HELD_OUT_PAIRS[:PROBE_PAIRS]
    reference = evaluate(default_model.model, pairs).accuracy
    model = packed_model(build_eager(copy.deepcopy(default_model.model), "bf16"))
    compile_layers(model)
    store = PagedKVStore(KVMemoryPool(default_model.config, 4096, block_tokens=16, dtype=torch.bfloat16))
    served = addition_accuracy(model, store, "kernel", pairs)
    assert served >= reference - ACCURACY_TOLERANCE, f"compiled bf16 layers {served:.3f} against fp32 {reference:.3f}"
