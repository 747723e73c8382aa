"""Fusion: a Llama block's element-wise work around its bf16 products as six C passes instead of some forty operators.

Between its four matrix products a Llama block norms, rotates, converts between fp32 and bf16, gates with SiLU and adds
residuals. Eager PyTorch runs each as its own operator: a dispatch, an allocation and a pass over memory each. An
inference engine fuses them into kernels that read each row once (TensorRT's layer fusion, vLLM's compiled CPU
kernels). Here that is ``fused_block_ops.c`` beside this file, built for this machine at start-up
(:mod:`.native_library`), one pass per stage:

    attention_inputs:  rms_norm_bf16 -> qkv product -> rope_from_bf16 (fp32 q, k, v, as attention reads them)
    after_attention:   rows_bf16 -> o product -> add_rms_norm_bf16 -> gate/up product -> silu_mul_bf16 -> down product -> add_bf16

Every pass rounds where the eager bf16 block rounds (the C file says where the order of a sum differs, to a unit in the
last place). A call of fewer rows than the products' ``min_rows`` (where :mod:`.bf16_matmul` multiplies in fp32) keeps
the block's eager halves, and so does a model whose start-up found bf16 slower at every size."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from chapters.ch05_inference_engine.bf16_matmul import NEVER, Bf16GatedMLP, Bf16MatmulLinear, linear_bf16, padded_rows
from chapters.ch05_inference_engine.native_library import NativeBuildFailed, build_library
from shared.llama import LlamaBlock
from shared.model import DecoderModel
from shared.paths import ENGINE_CACHE_DIR

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_block_ops.c")
# -ffp-contract=off: each product and sum rounds on its own, as eager's do; -fno-trapping-math lets GCC vectorise the exponential
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "rms_norm_bf16": [_P, _P, _I, _I, _I, _F, _P],
    "add_rms_norm_bf16": [_P, _P, _P, _I, _I, _I, _F, _P, _P],
    "add_bf16": [_P, _P, _I, _I, _P],
    "rope_from_bf16": [_P, _I, _I, _I, _I, _P, _P, _P, _P],
    "silu_mul_bf16": [_P, _I, _I, _P],
    "rows_bf16": [_P, _I, _I, _I, _P],
}


@functools.cache
def fused_ops() -> ctypes.CDLL:
    """``fused_block_ops.c`` built for this machine once (into the engine cache) and loaded; :class:`NativeBuildFailed`
    with the reason where it cannot be."""
    return build_library(SOURCE, FLAGS, SIGNATURES, ENGINE_CACHE_DIR)


class FusedHalves:
    """One block's ``attention_inputs`` and ``after_attention`` through the C passes, bound to its weights; the block's own
    eager halves for calls below its products' ``min_rows``. Holds no handle to the library (a deep copy stays possible)."""

    def __init__(self, block: LlamaBlock) -> None:
        attention, mlp = block.self_attn, block.mlp
        if not (isinstance(attention.qkv_proj, Bf16MatmulLinear) and isinstance(mlp, Bf16GatedMLP)):
            raise ValueError("fused blocks need chapter 5's bf16 products (with_bf16_matmuls) in a Llama block")
        fused_ops()  # built (or refused) now, not in the first request
        self.block = block
        self.eager_inputs, self.eager_after = block.attention_inputs, block.after_attention
        self.qkv, self.o, self.gate_up, self.down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.min_rows = self.qkv.min_rows
        self.n_head, self.n_kv_head, self.head_dim = attention.n_head, attention.n_kv_head, attention.head_dim
        rotary = block._rotary[0]
        self.cos, self.signed_sin = rotary.cos.contiguous(), rotary.signed_sin.contiguous()

    def attention_inputs(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch, length, width = x.shape
        rows = batch * length
        if rows < self.min_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return self.eager_inputs(x, position_ids)
        ops, x, norm = fused_ops(), x.contiguous(), self.block.input_layernorm
        normed = torch.empty(padded_rows(rows), width, dtype=torch.bfloat16)
        ops.rms_norm_bf16(x.data_ptr(), norm.weight.data_ptr(), rows, normed.shape[0], width, norm.eps, normed.data_ptr())
        qkv16 = linear_bf16(normed, self.qkv.weight_bf16, self.qkv.bias_bf16)
        # (B or 1, T) as one position per row; a negative one counts from the end, as the eager block's indexing does
        positions = position_ids.expand(batch, length).reshape(-1).to(torch.int64).remainder(self.cos.shape[0])
        qkv = torch.empty(batch, length, qkv16.shape[1], dtype=torch.float32)
        ops.rope_from_bf16(qkv16.data_ptr(), rows, qkv16.shape[1], self.n_head + self.n_kv_head, self.head_dim,
                           positions.data_ptr(), self.cos.data_ptr(), self.signed_sin.data_ptr(), qkv.data_ptr())
        q, k, v = qkv.view(batch, length, -1, self.head_dim).split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def after_attention(self, x: Tensor, y: Tensor) -> Tensor:
        batch, length, width = x.shape
        rows = batch * length
        if rows < self.min_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return self.eager_after(x, y)
        ops, x, padded, norm = fused_ops(), x.contiguous(), padded_rows(rows), self.block.post_attention_layernorm
        y = y.transpose(1, 2).reshape(rows, -1).contiguous()  # a view where attention wrote (B, T, H, D): no copy
        attended = torch.empty(padded, y.shape[1], dtype=torch.bfloat16)
        ops.rows_bf16(y.data_ptr(), rows, padded, y.shape[1], attended.data_ptr())
        projected = linear_bf16(attended, self.o.weight_bf16, self.o.bias_bf16)
        residual, normed = torch.empty_like(x), torch.empty(padded, width, dtype=torch.bfloat16)
        ops.add_rms_norm_bf16(x.data_ptr(), projected.data_ptr(), norm.weight.data_ptr(), rows, padded, width, norm.eps,
                              residual.data_ptr(), normed.data_ptr())
        gate_up = linear_bf16(normed, self.gate_up.weight_bf16, self.gate_up.bias_bf16)
        hidden = torch.empty(padded, gate_up.shape[1] // 2, dtype=torch.bfloat16)
        ops.silu_mul_bf16(gate_up.data_ptr(), padded, hidden.shape[1], hidden.data_ptr())
        down = linear_bf16(hidden, self.down.weight_bf16, self.down.bias_bf16)
        ops.add_bf16(residual.data_ptr(), down.data_ptr(), rows, width, residual.data_ptr())
        return residual


def fuse_blocks(model: DecoderModel) -> DecoderModel:
    """``model`` (a Llama through :func:`with_bf16_matmuls`, changed in place) whose blocks run :class:`FusedHalves`."""
    for block in model.blocks:
        halves = FusedHalves(block)
        block.attention_inputs, block.after_attention = halves.attention_inputs, halves.after_attention
    return model


def with_fused_blocks(model: DecoderModel) -> DecoderModel:
    """``model`` (through :func:`with_bf16_matmuls`) with :func:`fuse_blocks` where it applies: a Llama that multiplies in
    bf16 here, and a C compiler. Records why not, or None, as ``model.fusion_missing``."""
    if model.config.family != "llama":
        model.fusion_missing = f"fused blocks are written for Llama blocks, not {model.config.family}'s"
    elif model.bf16_tuning["min_rows"] >= NEVER:
        model.fusion_missing = "no product multiplies in bf16 here, so there is nothing around them to fuse"
    else:
        try:
            fuse_blocks(model)
            model.fusion_missing = None
        except NativeBuildFailed as error:
            model.fusion_missing = f"fused blocks: {error}"
            log.warning("the eager blocks serve: %s", model.fusion_missing)
    return model
