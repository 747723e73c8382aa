"""Chapter 5's fused blocks: a Llama block's element-wise work around its bf16 products as C passes, each checked against
the PyTorch operators it replaces (the oracle: what the eager bf16 block computes), then whole blocks, batched and
packed, and a model's greedy tokens against the eager ones; and where the bf16 engine fuses and where it says why not."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from chapters.ch05_inference_engine import fused_blocks
from chapters.ch05_inference_engine.bf16_matmul import NEVER, bf16_rows, with_bf16_matmuls
from chapters.ch05_inference_engine.engine import build_eager
from chapters.ch05_inference_engine.fused_blocks import FusedHalves, fuse_blocks, fused_ops, with_fused_blocks
from chapters.ch05_inference_engine.native_library import NativeBuildFailed
from shared.llama import RMSNorm, RotaryEmbedding
from shared.weights import load_model

ROWS, PADDED = 5, 16


@pytest.fixture(scope="module")
def ops():
    return fused_ops()


@pytest.fixture(scope="module")
def llama():
    """The tiny Llama with every product in bf16 from one row, so every call takes the fused passes."""
    return with_bf16_matmuls(copy.deepcopy(load_model("dummy", "llama-tiny").model), min_rows=1)


def _one_causal_sequence(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _differing(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of bf16 numbers that differ, each by at most one unit in the last place (else an assertion fails)."""
    steps = torch.where(a == b, 0, (a.view(torch.int16).int() - b.view(torch.int16).int()).abs())  # -0 == 0
    assert steps.max() <= 1, f"numbers {steps.max().item()} bf16 steps apart"
    return (steps > 0).float().mean().item()


def test_the_norm_pass_gives_the_eager_norm_in_bf16_and_zero_padding(ops) -> None:
    torch.manual_seed(0)
    norm, x = RMSNorm(576, 1e-5), torch.randn(ROWS, 576) * 4
    norm.weight.data = torch.rand(576) + 0.5
    out = torch.full((PADDED, 576), 7.0, dtype=torch.bfloat16)
    ops.rms_norm_bf16(x.data_ptr(), norm.weight.data_ptr(), ROWS, PADDED, 576, norm.eps, out.data_ptr())
    with torch.no_grad():
        assert _differing(out, bf16_rows(norm(x))) < 0.01
    assert not out[ROWS:].any()


def test_the_residual_and_norm_pass_adds_exactly_then_norms(ops) -> None:
    torch.manual_seed(1)
    norm, x, y = RMSNorm(576, 1e-5), torch.randn(ROWS, 576), torch.randn(PADDED, 576).to(torch.bfloat16)
    total, out = torch.empty(ROWS, 576), torch.empty(PADDED, 576, dtype=torch.bfloat16)
    ops.add_rms_norm_bf16(x.data_ptr(), y.data_ptr(), norm.weight.data_ptr(), ROWS, PADDED, 576, norm.eps, total.data_ptr(),
                          out.data_ptr())
    assert torch.equal(total, x + y[:ROWS].float())
    with torch.no_grad():
        assert _differing(out, bf16_rows(norm(total))) < 0.01
    plain = torch.empty(ROWS, 576)
    ops.add_bf16(x.data_ptr(), y.data_ptr(), ROWS, 576, plain.data_ptr())
    assert torch.equal(plain, total)


def test_the_conversion_pass_rounds_as_torch_and_pads_with_zeros(ops) -> None:
    x, out = torch.randn(ROWS, 576) * 1000, torch.full((PADDED, 576), 7.0, dtype=torch.bfloat16)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0 + 2**-8])  # a tie, rounded to even
    ops.rows_bf16(x.data_ptr(), ROWS, PADDED, 576, out.data_ptr())
    expected = x.to(torch.bfloat16)
    assert torch.equal(out[:ROWS].isnan(), expected.isnan())  # NaN stays NaN (the bits of torch's NaN may differ)
    assert torch.equal(torch.where(expected.isnan(), 0, out[:ROWS]), torch.where(expected.isnan(), 0, expected))
    assert not out[ROWS:].any()


def test_the_rotation_pass_turns_queries_and_keys_exactly_as_eager_and_leaves_values(ops, llama) -> None:
    config = llama.config
    rotary, heads, kv_heads, dim = RotaryEmbedding(config), config.n_head, config.kv_heads, config.head_dim
    width = (heads + 2 * kv_heads) * dim
    torch.manual_seed(2)
    qkv = torch.randn(PADDED, width).to(torch.bfloat16)
    positions = torch.tensor([3, 0, 9, 4, config.n_ctx - 1])
    out = torch.empty(ROWS, width)
    ops.rope_from_bf16(qkv.data_ptr(), ROWS, width, heads + kv_heads, dim, positions.data_ptr(), rotary.cos.data_ptr(),
                       rotary.signed_sin.data_ptr(), out.data_ptr())
    widened = qkv[:ROWS].float()
    turned = rotary(widened[None, :, : (heads + kv_heads) * dim].view(1, ROWS, -1, dim), positions[None])
    assert torch.equal(out[:, : (heads + kv_heads) * dim], turned.reshape(ROWS, -1))
    assert torch.equal(out[:, (heads + kv_heads) * dim :], widened[:, (heads + kv_heads) * dim :])


def test_the_gate_pass_gives_eager_silu_times_up_in_bf16(ops) -> None:
    torch.manual_seed(3)
    gate_up = (torch.randn(PADDED, 2 * 1536) * 6).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # past the exponential's clamp, and zero
    out = torch.empty(PADDED, 1536, dtype=torch.bfloat16)
    ops.silu_mul_bf16(gate_up.data_ptr(), PADDED, 1536, out.data_ptr())
    gate, up = gate_up.chunk(2, dim=-1)
    assert _differing(out, F.silu(gate) * up) < 0.01


def test_fused_blocks_compute_what_the_eager_blocks_compute(llama) -> None:
    block = llama.blocks[1]
    halves = FusedHalves(block)
    torch.manual_seed(4)
    x, positions = torch.randn(1, ROWS, llama.config.n_embd), torch.arange(ROWS)[None] + 2
    with torch.no_grad():
        for eager, fused in zip(block.attention_inputs(x, positions), halves.attention_inputs(x, positions)):
            assert eager.shape == fused.shape and eager.stride() == fused.stride()
            torch.testing.assert_close(fused, eager, rtol=0.02, atol=0.02)
        y = torch.randn(1, llama.config.n_head, ROWS, llama.config.head_dim)
        torch.testing.assert_close(halves.after_attention(x, y), block.after_attention(x, y), rtol=0.02, atol=0.02)


def test_a_fused_model_gives_the_eager_bf16_models_greedy_tokens(llama) -> None:
    fused = fuse_blocks(copy.deepcopy(llama))
    torch.manual_seed(5)
    ids = torch.randint(0, llama.config.vocab_size, (40,))
    positions = torch.arange(40)
    with torch.no_grad():
        eager_logits = llama.forward_packed(ids, positions, _one_causal_sequence, positions)
        fused_logits = fused.forward_packed(ids, positions, _one_causal_sequence, positions)
    assert (eager_logits.argmax(-1) == fused_logits.argmax(-1)).float().mean() >= 0.95
    torch.testing.assert_close(fused_logits, eager_logits, rtol=0.05, atol=0.05)


def test_batched_rows_with_their_own_positions_are_fused_as_the_eager_blocks_compute_them(llama) -> None:
    """Chapter 5's own batches: (B, T) rows, left-padded, each row's positions its own (a padded slot's negative one
    counts from the end, as the eager block's indexing does)."""
    block = llama.blocks[0]
    halves = FusedHalves(block)
    torch.manual_seed(6)
    x = torch.randn(3, 4, llama.config.n_embd)
    positions = torch.tensor([[0, 1, 2, 3], [-1, 0, 1, 2], [5, 6, 7, 8]])
    with torch.no_grad():
        for eager, fused in zip(block.attention_inputs(x, positions), halves.attention_inputs(x, positions)):
            assert eager.shape == fused.shape
            torch.testing.assert_close(fused, eager, rtol=0.02, atol=0.02)
        y = torch.randn(3, llama.config.n_head, 4, llama.config.head_dim)
        torch.testing.assert_close(halves.after_attention(x, y), block.after_attention(x, y), rtol=0.02, atol=0.02)


def test_calls_below_min_rows_keep_the_eager_halves(monkeypatch) -> None:
    model = with_bf16_matmuls(copy.deepcopy(load_model("dummy", "llama-tiny").model), min_rows=16)
    block = fuse_blocks(model).blocks[0]
    monkeypatch.setattr(fused_blocks, "fused_ops", lambda: pytest.fail("a call below min_rows reached the C passes"))
    with torch.no_grad():
        block.attention_inputs(torch.randn(1, 15, model.config.n_embd), torch.arange(15)[None])


def test_a_fused_model_copies_and_each_copy_computes_with_its_own_weights(llama) -> None:
    fused = fuse_blocks(copy.deepcopy(llama))
    twin = copy.deepcopy(fused)
    twin.blocks[0].post_attention_layernorm.weight.data.mul_(0)  # the copy's weights only
    ids, positions = torch.arange(8), torch.arange(8)
    with torch.no_grad():
        before = fused.forward_packed(ids, positions, _one_causal_sequence, positions)
        assert not torch.equal(twin.forward_packed(ids, positions, _one_causal_sequence, positions), before)
        assert torch.equal(fused.forward_packed(ids, positions, _one_causal_sequence, positions), before)


def test_the_bf16_engine_fuses_a_llama_that_multiplies_in_bf16_and_says_why_it_does_not_otherwise(monkeypatch) -> None:
    llama = load_model("dummy", "llama-tiny").model
    monkeypatch.setattr("chapters.ch05_inference_engine.engine.with_bf16_matmuls", lambda model: with_bf16_matmuls(model, 1))
    engine = build_eager(llama, "bf16")
    assert engine.module.fusion_missing is None and "fused C passes" in engine.conversion.notes[-1]
    assert all("attention_inputs" in vars(block) and "after_attention" in vars(block) for block in engine.module.blocks)
    assert not any("attention_inputs" in vars(block) for block in llama.blocks)  # the fp32 model is never touched
    never = with_fused_blocks(with_bf16_matmuls(copy.deepcopy(llama), min_rows=NEVER))
    assert "nothing around them to fuse" in never.fusion_missing and "attention_inputs" not in vars(never.blocks[0])
    gpt = with_fused_blocks(with_bf16_matmuls(copy.deepcopy(load_model("dummy").model), min_rows=1))
    assert "Llama blocks" in gpt.fusion_missing

    def no_compiler():
        raise NativeBuildFailed("built with a C compiler ($CC, cc or gcc), and none was found")
    monkeypatch.setattr(fused_blocks, "fused_ops", no_compiler)
    unbuilt = build_eager(llama, "bf16")
    assert "none was found" in unbuilt.module.fusion_missing and "none was found" in unbuilt.conversion.notes[-1]
    assert "attention_inputs" not in vars(unbuilt.module.blocks[0])  # served by the eager blocks
