"""Chapter 5's engines and precisions on the Llama family: fp32 engines give the oracle's tokens, reduced ones a bound.

The model is ``llama-tiny`` (random weights, byte vocabulary, 4 query heads over 2 key/value heads)
with its block weights scaled up (:func:`sharpened`): at the seeded init's small scale every block is
close to the identity and greedy decoding echoes the last token whatever attention, positions or
the MLP compute, so no broken engine could show. SmolLM2-135M (the real weights) checks bf16 once.

Reduced precisions are bounded by **teacher-forced agreement**: fp32's greedy tokens are fed to the
reduced engine step by step, and each position counts whether it would have picked the same next
token. A greedy row that flips once differs at every later position, so the plain greedy figure
swings with one near-tie; this one counts each position once. The bounds sit below the lowest
figure measured over :func:`agreement_prompts`' seeds 0 to 3, with a margin for another CPU's
kernels: bf16 with every product in bf16 at least :data:`MIN_BF16_AGREEMENT`, torchao's int8 at
least :data:`MIN_INT8_AGREEMENT`.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chapters.ch03_dynamic_batching.batched_generation import batched_greedy, generate_batch
from chapters.ch04_memory_pool.memory_pool import BatchCacheLease, KVMemoryPool
from chapters.ch05_inference_engine import engines
from chapters.ch05_inference_engine.bf16_matmul import (
    BLOCK_LINEARS,
    NEVER,
    Bf16GatedMLP,
    Bf16MatmulLinear,
    bf16_rows,
    onednn_layout,
    with_bf16_matmuls,
)
from chapters.ch05_inference_engine.cudagraph_engine import CudaGraphEngine
from chapters.ch05_inference_engine.engine import ConversionReport, Engine, TorchModuleEngine, build_eager
from chapters.ch05_inference_engine.engines import build_engine, choose_default, unavailable_reason
from chapters.ch05_inference_engine.fused_blocks import with_fused_blocks
from shared.generation import reference_greedy
from shared.model import FAMILIES, PRESETS, DecoderModel, DynamicKVCache, build_model, init_weights
from shared.paths import REPO_ROOT
from shared.weights import LoadedModel, WeightsError, load_model

CPU = torch.device("cpu")
# Teacher-forced agreement with fp32 over agreement_prompts() (module docstring): far above the few
# percent a broken engine scores, below what rounding alone cost.
MIN_BF16_AGREEMENT = 0.90
MIN_INT8_AGREEMENT = 0.80
SHARPEN = 4.0  # block weights x4: far enough from the identity that tokens depend on every part of the block

# Mixed lengths, so a batch is left-padded; one row a single token.
PROMPTS = [list(b"hello world"), list(b"ab"), list(b"the quick brown fox "), list(b"t"), list(b"71+28=82\n55+17=")]
NEW_TOKENS = [10, 6, 8, 12, 5]
AGREEMENT_TOKENS = 16  # per prompt of agreement_prompts(): 256 positions, so one flip moves the figure by 0.4 %


def agreement_prompts(seed: int = 0, n: int = 16) -> list[list[int]]:
    """``n`` seeded random-byte prompts of 1 to 23 bytes (the bounds were measured on seeds 0 to 3)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=generator).tolist()
    return [torch.randint(1, 256, (length,), generator=generator).tolist() for length in lengths]


def sharpened(model: DecoderModel) -> DecoderModel:
    """``model`` with every block matrix scaled by :data:`SHARPEN` (the embedding and output layer kept)."""
    with torch.no_grad():
        for block in model.blocks:
            for parameter in block.parameters():
                if parameter.dim() == 2:
                    parameter.mul_(SHARPEN)
    return model


@pytest.fixture(scope="module")
def llama() -> DecoderModel:
    return sharpened(load_model("dummy", "llama-tiny").model)


@pytest.fixture(scope="module")
def expected(llama: DecoderModel) -> list[list[int]]:
    return [reference_greedy(llama, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]


@pytest.fixture(scope="module")
def fp32_continuations(llama: DecoderModel) -> list[list[int]]:
    return [reference_greedy(llama, p, AGREEMENT_TOKENS) for p in agreement_prompts()]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    try:
        return load_model("smollm2")
    except WeightsError as exc:
        pytest.skip(str(exc))


def generate_in_pool(engine: Engine, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """Chapter 3's batched generation with chapter 4's pool (in the engine's dtype): the server's path."""
    pool = KVMemoryPool(engine.config, 4096, device=engine.device, dtype=engine.dtype)
    with BatchCacheLease(pool) as lease:
        rows = generate_batch(engine, prompts, new_tokens, 0, cache_factory=lease.new_cache)
    assert pool.stats().blocks_used == 0
    return [row.output_ids for row in rows]


@torch.no_grad()
def teacher_forced_agreement(engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """The share of positions where ``engine``, given the reference's prefix, picks the reference's next token."""
    same = total = 0
    for prompt, tokens in zip(prompts, reference):
        cache = DynamicKVCache(engine.config.n_layer)
        logits = engine.prefill(torch.tensor([prompt]), None, None, cache)
        for token in tokens:
            same += int(logits.argmax(-1)) == token
            total += 1
            logits = engine.decode(torch.tensor([[token]]), None, None, cache)
    return same / total


def bf16_everywhere(model: DecoderModel) -> TorchModuleEngine:
    """Eager bf16 with every block product in bf16 (from one row) and the element-wise work between them in the fused
    C passes, as the bf16 engine builds a Llama: the most rounding this path can do, on any CPU (the measured crossover
    could keep a decode step's few rows fp32)."""
    module = with_fused_blocks(with_bf16_matmuls(copy.deepcopy(model), min_rows=1))
    assert module.fusion_missing is None, module.fusion_missing
    return TorchModuleEngine("eager", "bf16", module, model.config, model.device, torch.float32, ConversionReport())


def available(name: str, precision: str) -> None:
    reason = unavailable_reason(name, precision, CPU)
    if reason:
        pytest.skip(f"{name}/{precision} unavailable here: {reason}")


# ---------------------------------------------------------------------------------------------
# fp32 engines: the oracle's tokens, through the pool
# ---------------------------------------------------------------------------------------------


def test_the_sharpened_model_is_a_real_test(llama: DecoderModel, expected: list[list[int]]) -> None:
    """Its tokens are not an echo of the prompt's last byte: a broken block would change them."""
    echoes = sum(token == prompt[-1] for prompt, row in zip(PROMPTS, expected) for token in row)
    assert echoes < sum(NEW_TOKENS) // 4


def test_eager_fp32_returns_the_oracles_tokens(llama: DecoderModel, expected: list[list[int]]) -> None:
    assert generate_in_pool(build_eager(llama, "fp32"), PROMPTS, NEW_TOKENS) == expected


@pytest.fixture(scope="module")
def onnx_engine(llama: DecoderModel, tmp_path_factory) -> Engine:
    available("onnxruntime", "fp32")
    from chapters.ch05_inference_engine.onnx_engine import build_onnxruntime

    return build_onnxruntime(llama, "fp32", cache_dir=tmp_path_factory.mktemp("onnx"))


def test_onnxruntime_fp32_returns_the_oracles_tokens(onnx_engine: Engine, expected: list[list[int]]) -> None:
    assert generate_in_pool(onnx_engine, PROMPTS, NEW_TOKENS) == expected


def test_the_onnx_graphs_take_kv_heads_and_positions(onnx_engine: Engine, llama: DecoderModel) -> None:
    """The decode graph's past has the key/value heads; the position ids reach the rotary (not folded away)."""
    import onnx

    config = llama.config
    decode = onnx.load(str(REPO_ROOT / onnx_engine.conversion.artifact_paths[1]))  # an absolute path stays itself
    inputs = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in decode.graph.input}
    assert "position_ids" in inputs
    assert inputs["past_key_0"][1] == inputs["past_value_0"][1] == config.kv_heads < config.n_head
    assert inputs["past_key_0"][3] == config.head_dim
    ids = torch.tensor([list(b"the quick brown fox")])
    at_zero = onnx_engine._prefill.run(None, {"input_ids": ids.numpy(), "position_ids": torch.zeros_like(ids).numpy(),
                                             "attention_mask": torch.ones_like(ids).numpy()})[0]
    counted = onnx_engine.prefill(ids, None, None, None)
    torch.testing.assert_close(counted, llama.prefill(ids, None, None, None), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(torch.from_numpy(at_zero), counted, atol=1e-3)  # the positions change the logits


@pytest.mark.slow  # Inductor's compilation: about a minute on a small CPU
def test_compile_fp32_returns_the_oracles_tokens(llama: DecoderModel, expected: list[list[int]]) -> None:
    available("compile", "fp32")
    assert generate_in_pool(build_engine(llama, "compile", "fp32"), PROMPTS, NEW_TOKENS) == expected


def test_the_cudagraph_static_step_uncaptured_gives_the_oracles_tokens(llama: DecoderModel, expected: list[list[int]]) -> None:
    """The step a CUDA graph records, run on the CPU: its own cache (5 rows in the 8-row bucket), then a pool's."""
    engine = CudaGraphEngine(llama, "fp32", capture=False, batch_buckets=(1, 2, 4, 8), length_buckets=(16, 32), max_len=48)
    assert engine.static_keys[0].shape == (8, llama.config.kv_heads, 48, llama.config.head_dim)
    rows = batched_greedy(engine, PROMPTS, NEW_TOKENS, 0, cache_factory=engine.new_cache)
    assert [r.output_ids for r in rows] == expected
    assert engine.stats["uncaptured_static_steps"] == max(NEW_TOKENS) - 1 and engine.stats["eager_steps"] == 0
    assert generate_in_pool(engine, PROMPTS, NEW_TOKENS) == expected and engine.stats["adoptions"] == 1


# ---------------------------------------------------------------------------------------------
# bf16 on the CPU: every block linear layer swapped, the gated MLP in the GPT's Bf16MLP shape
# ---------------------------------------------------------------------------------------------


def test_every_family_names_its_block_linears() -> None:
    assert set(BLOCK_LINEARS) == set(FAMILIES)


def test_the_bf16_swap_leaves_no_fp32_linear_layer_in_a_block(llama: DecoderModel) -> None:
    module = with_bf16_matmuls(copy.deepcopy(llama), min_rows=NEVER)
    for block in module.blocks:
        plain = [name for name, m in block.named_modules() if isinstance(m, nn.Linear)]
        assert not plain, f"left fp32: {plain}"
        assert isinstance(block.mlp, Bf16GatedMLP)
        assert {n for n, m in block.named_modules() if isinstance(m, Bf16MatmulLinear)} == {
            "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}


def test_bf16_never_used_computes_exactly_as_fp32(llama: DecoderModel) -> None:
    """Below the crossover every product is the fp32 one: ``multiplies_in_bf16`` says False and means it."""
    module = with_bf16_matmuls(copy.deepcopy(llama), min_rows=NEVER)
    ids = torch.tensor([list(b"the quick brown fox")])
    assert torch.equal(module(ids), llama(ids))


def test_the_output_layer_multiplies_in_bf16_from_min_rows_and_exactly_below(llama: DecoderModel) -> None:
    """The logits of a call of at least ``min_rows`` rows are the bf16 product of the final norm's output with the
    (tied) embedding; below it, fp32's to the bit. A deep copy's head is its own (the copy's norm and layer)."""
    module = with_bf16_matmuls(copy.deepcopy(llama), min_rows=16)
    hidden = torch.randn(1, 16, llama.config.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        normed = llama.norm(hidden)
        bf16 = F.linear(normed.bfloat16(), llama.embed_tokens.weight.bfloat16()).float()
        assert torch.equal(module.head(hidden[:, :15]), llama.head(hidden[:, :15]))
        logits = module.head(hidden)
        torch.testing.assert_close(logits, bf16, atol=0.05, rtol=0.02)
        assert not torch.equal(logits, llama.head(hidden))
        copied = copy.deepcopy(module)
        assert copied.head.__self__ is copied and copied.bf16_output_layer is not module.bf16_output_layer
        copied.norm.weight.mul_(2)
        assert not torch.equal(copied.head(hidden), logits)


@pytest.mark.parametrize("min_rows, fp32_kept, bf16_kept", [(1, False, True), (8, True, True), (NEVER, True, False)])
def test_a_bf16_layer_keeps_only_the_weights_its_calls_read(llama: DecoderModel, min_rows: int, fp32_kept: bool,
                                                             bf16_kept: bool) -> None:
    """Every call at or above ``min_rows`` reads the bf16 copy, every call below it the fp32 one: a copy
    no call reads is memory for nothing (the served model's footprint), and a deep copy keeps the rule."""
    module = with_bf16_matmuls(copy.deepcopy(llama), min_rows=min_rows)
    for layer in [module, copy.deepcopy(module)]:
        linears = [m for m in layer.modules() if isinstance(m, Bf16MatmulLinear)]
        assert {m.weight is not None for m in linears} == {fp32_kept}
        assert {m.weight_bf16 is not None for m in linears} == {bf16_kept}
        if bf16_kept:  # a copy lays its bf16 weights out as the original's are (oneDNN's blocked layout where it has one)
            assert {m.weight_bf16.is_mkldnn for m in linears} == {onednn_layout(torch.ones(2, 2).bfloat16()).is_mkldnn}
        ids = torch.tensor([list(b"the quick brown fox")])
        with torch.no_grad():
            torch.testing.assert_close(layer(ids), llama(ids), atol=0.5, rtol=0.05)


@pytest.mark.parametrize("rows, padded", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 48)])
def test_bf16_rows_pad_to_the_bucket_only_what_is_not_already_a_multiple(rows: int, padded: int) -> None:
    x = torch.randn(rows, 8)
    out = bf16_rows(x)
    assert out.shape == (padded, 8) and out.dtype == torch.bfloat16
    assert torch.equal(out[:rows], x.bfloat16()) and not out[rows:].any()


def test_the_gated_mlp_is_exact_below_its_threshold_and_bf16_above(llama: DecoderModel) -> None:
    mlp = llama.blocks[0].mlp
    gated = Bf16GatedMLP(copy.deepcopy(mlp), min_rows=8)
    width = llama.config.n_embd
    torch.manual_seed(0)
    small, large = torch.randn(1, 4, width), torch.randn(1, 20, width)
    with torch.no_grad():
        assert torch.equal(gated(small), mlp(small))
        gate, up = torch.nn.functional.linear(large.bfloat16(), mlp.gate_up_proj.weight.bfloat16()).chunk(2, dim=-1)
        in_bf16 = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, mlp.down_proj.weight.bfloat16()).float()
        out = gated(large)
        assert out.dtype == torch.float32 and not torch.equal(out, mlp(large))  # it took the bf16 path ...
        torch.testing.assert_close(out, in_bf16, atol=1e-2, rtol=1e-2)  # ... which is the bf16 computation ...
        torch.testing.assert_close(out, mlp(large), atol=0.05, rtol=0.05)  # ... close to fp32


def test_the_bf16_engine_on_a_llama_measures_its_crossover_on_the_gate_up_product(llama: DecoderModel) -> None:
    engine = build_eager(llama, "bf16")
    assert engine.dtype == torch.float32 and engine.conversion.notes[0].startswith("bf16 matmuls ")
    assert sum(isinstance(m, Bf16MatmulLinear) for m in engine.module.modules()) == 4 * llama.config.n_layer + 1  # the output layer


def test_bf16_tokens_agree_with_fp32(llama: DecoderModel, fp32_continuations: list[list[int]]) -> None:
    assert teacher_forced_agreement(bf16_everywhere(llama), agreement_prompts(), fp32_continuations) >= MIN_BF16_AGREEMENT


def test_int8_tokens_agree_with_fp32(llama: DecoderModel, fp32_continuations: list[list[int]]) -> None:
    available("eager", "int8")
    engine = build_eager(llama, "int8")
    assert teacher_forced_agreement(engine, agreement_prompts(), fp32_continuations) >= MIN_INT8_AGREEMENT
    assert generate_in_pool(engine, PROMPTS[:2], NEW_TOKENS[:2])  # and it runs the pooled path


def test_int8_keeps_an_untied_output_layer_fp32() -> None:
    """torchao quantizes the blocks' linear layers only: the output layer decides the argmax, tied or not."""
    available("eager", "int8")
    config = dataclasses.replace(PRESETS["llama-tiny"], tie_word_embeddings=False)
    engine = build_eager(init_weights(build_model(config)), "int8")
    assert type(engine.module.lm_head.weight) is nn.Parameter and engine.module.lm_head.weight.dtype == torch.float32
    assert all(type(block.mlp.down_proj.weight) is not nn.Parameter for block in engine.module.blocks)


# ---------------------------------------------------------------------------------------------
# The default rule: the arithmetic task scores no Llama
# ---------------------------------------------------------------------------------------------


def test_auto_on_a_llama_is_fp32_eager_and_says_why(llama: DecoderModel, monkeypatch, caplog) -> None:
    monkeypatch.setattr(engines, "measure_candidates", lambda *args: pytest.fail("nothing is measured for a Llama"))
    with caplog.at_level("INFO", logger=engines.log.name):
        assert choose_default(llama) == ("eager", "fp32")
    assert "held-out arithmetic" in caplog.text and "llama" in caplog.text


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M: the real weights
# ---------------------------------------------------------------------------------------------


def test_smollm2_bf16_agrees_with_fp32(smollm2: LoadedModel) -> None:
    """Short prompts, a few tokens: fp32 eager's greedy tokens (the pool path), bf16 forced on every product."""
    prompts = [smollm2.tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    reference = generate_in_pool(build_eager(smollm2.model, "fp32"), prompts, [8, 8])
    assert teacher_forced_agreement(bf16_everywhere(smollm2.model), prompts, reference) >= MIN_BF16_AGREEMENT


@pytest.mark.slow  # exporting 135 M parameters twice takes a minute or two
def test_smollm2_onnxruntime_fp32_returns_eagers_tokens(smollm2: LoadedModel, tmp_path) -> None:
    """9 query heads over 3 key/value heads, through the exported graphs and chapter 4's pool."""
    available("onnxruntime", "fp32")
    from chapters.ch05_inference_engine.onnx_engine import build_onnxruntime

    prompts = [smollm2.tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    reference = generate_in_pool(build_eager(smollm2.model, "fp32"), prompts, [8, 8])
    assert generate_in_pool(build_onnxruntime(smollm2.model, "fp32", cache_dir=tmp_path), prompts, [8, 8]) == reference
