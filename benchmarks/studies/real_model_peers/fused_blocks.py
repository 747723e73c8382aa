"""The study's second experiment on the element-wise share of chapter 8's step: a Llama block's work around its bf16
products as six C passes (``fused_block_ops.c`` beside this file) instead of some forty eager operators per block.

Where the profile of chapter 8's step on a real model lists its norms, rotation, SiLU, residual adds and fp32/bf16
conversions, vLLM's CPU backend runs the same work as compiled, fused kernels. The compiled-blocks experiment
(:mod:`.compiled_blocks`) fused them with Inductor and gave back the saving in guards and dispatch; this one calls
hand-written passes through ctypes, the way chapter 8 calls its decode kernel, so a block is six C calls, the four
oneDNN products and attention:

    attention_inputs:  rms_norm_bf16 -> qkv product -> rope_from_bf16 (fp32 q, k, v for the decode kernel)
    after_attention:   rows_bf16 -> o product -> add_rms_norm_bf16 -> gate/up product -> silu_mul_bf16 -> down product -> add_bf16

Every stage rounds where chapter 5's eager bf16 block rounds (``fused_block_ops.c`` says where the order of a sum
differs). Calls of fewer rows than the products' ``min_rows`` (where chapter 5 multiplies in fp32) keep the eager
halves. :func:`fuse_blocks` changes a model built by chapter 5's bf16 engine (:func:`with_bf16_matmuls`) in place; the
engine loops run it as ``ch08-fused``."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from chapters.ch05_inference_engine.bf16_matmul import Bf16GatedMLP, Bf16MatmulLinear, ROW_BUCKET, linear_bf16
from chapters.ch08_continuous_batching.fast.startup_cache import cache_dir, cpu_flags
from shared.llama import LlamaBlock
from shared.model import DecoderModel

SOURCE = Path(__file__).with_name("fused_block_ops.c")
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
    """``fused_block_ops.c`` built for this machine once (into chapter 8's start-up cache, named for a digest of the source,
    flags and CPU flags) and loaded; RuntimeError with the compiler's message if it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("the fused blocks are built with a C compiler ($CC, cc or gcc), and none was found")
    named = "\0".join([SOURCE.read_text(), *FLAGS, compiler, " ".join(cpu_flags(every=True))])
    target = cache_dir() / f"fused_block_ops-{hashlib.sha256(named.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        done = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    library = ctypes.CDLL(str(target))
    for name, arguments in SIGNATURES.items():
        getattr(library, name).argtypes, getattr(library, name).restype = arguments, None
    return library


def _padded(rows: int) -> int:
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


class FusedHalves:
    """One block's ``attention_inputs`` and ``after_attention`` through the C passes, bound to its weights; the block's own
    eager halves for calls below its products' ``min_rows``."""

    def __init__(self, block: LlamaBlock) -> None:
        attention, mlp = block.self_attn, block.mlp
        if not (isinstance(attention.qkv_proj, Bf16MatmulLinear) and isinstance(mlp, Bf16GatedMLP)):
            raise ValueError("fused blocks need chapter 5's bf16 products (with_bf16_matmuls) in a Llama block")
        self.ops, self.block = fused_ops(), block
        self.eager_inputs, self.eager_after = block.attention_inputs, block.after_attention
        self.qkv, self.o, self.gate_up, self.down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.min_rows = self.qkv.min_rows
        self.n_head, self.n_kv_head, self.head_dim = attention.n_head, attention.n_kv_head, attention.head_dim
        rotary = block._rotary[0]
        self.cos, self.signed_sin = rotary.cos.contiguous(), rotary.signed_sin.contiguous()

    def attention_inputs(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch, rows, width = x.shape
        if batch != 1 or rows < self.min_rows or x.dtype != torch.float32:
            return self.eager_inputs(x, position_ids)
        x, norm = x.contiguous(), self.block.input_layernorm
        normed = torch.empty(_padded(rows), width, dtype=torch.bfloat16)
        self.ops.rms_norm_bf16(x.data_ptr(), norm.weight.data_ptr(), rows, normed.shape[0], width, norm.eps, normed.data_ptr())
        qkv16 = linear_bf16(normed, self.qkv.weight_bf16, self.qkv.bias_bf16)
        positions = position_ids.reshape(-1).to(torch.int64).contiguous()
        qkv = torch.empty(1, rows, qkv16.shape[1], dtype=torch.float32)
        self.ops.rope_from_bf16(qkv16.data_ptr(), rows, qkv16.shape[1], self.n_head + self.n_kv_head, self.head_dim,
                                positions.data_ptr(), self.cos.data_ptr(), self.signed_sin.data_ptr(), qkv.data_ptr())
        q, k, v = qkv.view(1, rows, -1, self.head_dim).split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def after_attention(self, x: Tensor, y: Tensor) -> Tensor:
        batch, rows, width = x.shape
        if batch != 1 or rows < self.min_rows or x.dtype != torch.float32:
            return self.eager_after(x, y)
        x, padded, norm = x.contiguous(), _padded(rows), self.block.post_attention_layernorm
        y = y.transpose(1, 2).reshape(rows, -1).contiguous()  # a view of the decode kernel's output: no copy
        attended = torch.empty(padded, y.shape[1], dtype=torch.bfloat16)
        self.ops.rows_bf16(y.data_ptr(), rows, padded, y.shape[1], attended.data_ptr())
        projected = linear_bf16(attended, self.o.weight_bf16, self.o.bias_bf16)
        residual, normed = torch.empty_like(x), torch.empty(padded, width, dtype=torch.bfloat16)
        self.ops.add_rms_norm_bf16(x.data_ptr(), projected.data_ptr(), norm.weight.data_ptr(), rows, padded, width, norm.eps,
                                   residual.data_ptr(), normed.data_ptr())
        gate_up = linear_bf16(normed, self.gate_up.weight_bf16, self.gate_up.bias_bf16)
        hidden = torch.empty(padded, gate_up.shape[1] // 2, dtype=torch.bfloat16)
        self.ops.silu_mul_bf16(gate_up.data_ptr(), padded, hidden.shape[1], hidden.data_ptr())
        down = linear_bf16(hidden, self.down.weight_bf16, self.down.bias_bf16)
        self.ops.add_bf16(residual.data_ptr(), down.data_ptr(), rows, width, residual.data_ptr())
        return residual


def fuse_blocks(model: DecoderModel) -> DecoderModel:
    """``model`` (a Llama through chapter 5's bf16 engine, changed in place) whose blocks run :class:`FusedHalves`."""
    for block in model.blocks:
        halves = FusedHalves(block)
        block.attention_inputs, block.after_attention = halves.attention_inputs, halves.after_attention
    return model
