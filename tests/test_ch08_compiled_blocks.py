"""The real-model study's compiled blocks (``benchmarks/studies/real_model_peers/compiled_blocks.py``): chapter 8's
blocks with each half around attention through ``torch.compile``, attention between them bound per step as before.

Through the scheduler and runner, as ``test_ch08_llama`` serves the eager model (concurrent mixed-length
requests, chunked prefill, preemption): the oracle's greedy tokens, and every sampled row's logits within
fp32 summation order of the eager model's dense forward. One graph per half serves every layer, and chapter 5's
bf16 engine compiles within bf16 rounding of fp32. Chapter 5's oneDNN product reaches a
graph as one opaque operator. Compiling a model takes most of a minute here, so all but the last two tests are
in the slow suite (``make test-slow``): the blocks are a study's experiment, not a server's flag. (Not in
``make test``'s CPU pass: Inductor's C++ for torch's portable capability does not build.)
"""

from __future__ import annotations

import copy

import pytest
import torch

from chapter_flags import attention_here
from chapters.ch05_inference_engine import bf16_matmul
from chapters.ch03_dynamic_batching.step_loop import run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from benchmarks.studies.real_model_peers.compiled_blocks import compile_blocks
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, SchedulerConfig, Sequence
from shared.generation import reference_greedy
from shared.weights import load_model
from test_ch08_llama import FP32_LOGITS_BOUND, CheckedRunner, mixed_requests

BUDGET = SchedulerConfig(6, 48, "grow")  # 6 sequences, 48 tokens a step: the longer prompts are chunked


@pytest.fixture(scope="module", params=[("dummy", "llama-tiny"), ("default", None)], ids=["llama", "gpt"])
def eager_and_compiled(request):
    loaded = load_model(*[part for part in request.param if part])
    compiled = compile_blocks(copy.deepcopy(loaded.model), warm_up_tokens=(1, 2, BUDGET.max_num_seqs, BUDGET.max_num_batched_tokens))
    return loaded.model, compiled


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["gather", "kernel"])
def test_compiled_blocks_serve_the_oracles_tokens_and_the_eager_models_logits(eager_and_compiled, attention: str) -> None:
    eager, compiled = eager_and_compiled
    requests = mixed_requests(8, seed=6, max_new=40)
    answers = {tuple(prompt): reference_greedy(eager, prompt, n) for prompt, n in requests}
    store = PagedKVStore(KVMemoryPool(eager.config, 528, block_tokens=16))
    scheduler = ContinuousScheduler(store, BUDGET)
    runner = CheckedRunner(eager, store, attention_here(attention, store), answers, force=False)  # dense logits: eager's
    runner.model = compiled
    seqs = [Sequence(prompt, n) for prompt, n in requests]
    for seq in seqs:
        scheduler.add(seq)
    run_until_done(scheduler, runner)
    assert [seq.output_ids for seq in seqs] == [answers[tuple(prompt)] for prompt, _ in requests]
    assert runner.logits_error() <= FP32_LOGITS_BOUND
    assert scheduler.stats.preemptions > 0 and scheduler.manager.free_blocks == scheduler.manager.total_blocks


@pytest.mark.slow
def test_one_graph_per_half_serves_every_layer(eager_and_compiled) -> None:
    _, compiled = eager_and_compiled
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    halves = {name: {id(getattr(block, name).__wrapped__.__func__) for block in compiled.blocks}
              for name in ("attention_inputs", "after_attention")}
    assert all(len(functions) == 1 for functions in halves.values())  # the same code object in every layer
    for name in halves:
        code = getattr(type(compiled.blocks[0]), name).__code__
        assert 1 <= len(_debug_get_cache_entry_list(code)) <= 4  # a few guards (one token, dynamic counts), not one per layer


@pytest.mark.slow
def test_chapter_5s_bf16_engine_compiles_within_bf16_rounding_of_fp32() -> None:
    """Chapter 5's bf16 engine (its products in bf16, through oneDNN where this CPU multiplies bf16) with compiled blocks:
    a packed step's logits within bf16 rounding of the fp32 model's."""
    from chapters.ch05_inference_engine.engine import build_eager
    from chapters.ch08_continuous_batching.model_runner import packed_model

    loaded = load_model("dummy", "llama-tiny")
    fp32 = copy.deepcopy(loaded.model)
    model = compile_blocks(packed_model(build_eager(loaded.model, "bf16")), warm_up_tokens=(1, 2, 40))
    assert all(hasattr(block.after_attention, "__wrapped__") for block in model.blocks)
    ids = torch.randint(0, 256, (40,))
    positions, every = torch.arange(40), torch.arange(40)
    with torch.no_grad():
        served = model.forward_packed(ids, positions, _causal, every)
        dense = fp32(ids[None])[0]
    spread = (dense.max(dim=-1).values - dense.min(dim=-1).values)[:, None]
    assert float(((served - dense).abs() / spread).max()) <= BF16_PRODUCTS_BOUND


BF16_PRODUCTS_BOUND = 0.02  # bf16 products (8 bits of mantissa) through two layers, as a fraction of the logits' spread


def _causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_without_a_cpp_compiler_compiled_blocks_are_refused_in_one_line_before_anything_changes(monkeypatch) -> None:
    from benchmarks.studies.real_model_peers import compiled_blocks
    from shared.settings import SettingsError

    monkeypatch.setattr(compiled_blocks, "compiler_available", lambda: False)
    model = load_model("dummy", "llama-tiny").model
    with pytest.raises(SettingsError, match="C\\+\\+ compiler"):
        compiled_blocks.compile_blocks(model, warm_up_tokens=(1,))
    assert not any(hasattr(block.attention_inputs, "__wrapped__") for block in model.blocks)


@pytest.mark.parametrize("post_op", ["none", "gelu"])
def test_a_laid_out_onednn_weight_goes_through_torch_compile_as_one_opaque_product(post_op: str, monkeypatch) -> None:
    """Inductor lowers oneDNN's products only for weights that are constants of its graph; a block's laid-out weight
    is an input, so the product reaches a compiled graph as ``serving::onednn_product``. An fp32 layout stands in for
    bf16 where this CPU's oneDNN refuses bf16: the path is the same. At fp32 the compiled block is the eager one to
    the bit; in bf16 Inductor keeps SiLU's output in fp32 until the add, so the two differ by at most a rounding."""
    torch.manual_seed(0)
    weight = torch.randn(48, 32)
    dtype = torch.bfloat16 if bf16_matmul.onednn_takes_bf16() else torch.float32
    monkeypatch.setattr(bf16_matmul, "onednn_takes_bf16", lambda: True)
    laid_out = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype))
    assert laid_out.is_mkldnn
    product = bf16_matmul.linear_bf16 if post_op == "none" else bf16_matmul.linear_gelu_bf16

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(product(x * 2, laid_out, None)) + 1

    with torch.no_grad():  # one graph: asking whether oneDNN takes bf16 is answered while tracing, not in the graph
        explained = torch._dynamo.explain(block)(torch.randn(5, 32, dtype=dtype))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(block, dynamic=True)
    with torch.no_grad():
        for rows in (5, 16, 37):
            x = torch.randn(rows, 32, dtype=dtype)
            if dtype == torch.float32:
                assert torch.equal(compiled(x), block(x))
            else:
                torch.testing.assert_close(compiled(x), block(x), rtol=2**-7, atol=2**-7)
