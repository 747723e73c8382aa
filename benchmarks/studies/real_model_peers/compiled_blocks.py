"""The study's experiment: chapter 8's blocks with their two halves around attention through ``torch.compile``, the
norm, the products, the rotation, the MLP and the residual adds of a packed step as Inductor's generated loops (the
element-wise ops fused into a few passes instead of one eager operator each). Attention stays between the halves,
bound by the backend each step, so nothing about paging enters a graph (vLLM's CPU backend compiles its model the
same way, split at attention; nano-vllm compiles its norm, activation and rotation).

Every block has the same shapes, so one graph per half (and per guard Dynamo needs: one token, fewer rows than the
bf16 products' ``min_rows``, more) serves every layer: the weights are the graph's inputs, not its constants. Token
counts are dynamic. The compilation is paid by :func:`compile_blocks`'s warm-up, and Inductor keeps its code on disk
under ``ENGINE_CACHE_DIR/inductor``. The engine loops measure it as ``ch08-compiled``; it joins chapter 8's fast
path when a measurement says it is worth its lines there."""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from chapters.ch05_inference_engine.compiled_engine import compiler_available
from shared.model import DecoderModel
from shared.paths import ENGINE_CACHE_DIR
from shared.settings import SettingsError

log = logging.getLogger(__name__)
RECOMPILE_LIMIT = 64  # guards per half: a token count of 1, each side of min_rows, a few dtypes; never the layer


def compile_blocks(model: DecoderModel, warm_up_tokens: tuple[int, ...]) -> DecoderModel:
    """``model`` (changed in place) whose blocks run ``attention_inputs`` and ``after_attention`` compiled, warmed up on a
    packed step of each of ``warm_up_tokens`` tokens; :class:`SettingsError` without a C++ compiler on the CPU."""
    if model.device.type == "cpu" and not compiler_available():
        raise SettingsError("compiled blocks need a C++ compiler on the CPU (none found on PATH)")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ENGINE_CACHE_DIR / "inductor"))
    import torch._dynamo.config as dynamo_config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    for block in model.blocks:
        block.attention_inputs = torch.compile(block.attention_inputs, dynamic=True)
        block.after_attention = torch.compile(block.after_attention, dynamic=True)
    started = time.perf_counter()
    with torch.no_grad():
        for tokens in sorted(set(warm_up_tokens)):
            ids = torch.zeros(tokens, dtype=torch.long, device=model.device)
            positions = torch.arange(tokens, device=model.device)
            model.forward_packed(ids, positions, _one_causal_sequence, positions[-1:])
    log.info("compiled blocks: warmed up on %s tokens in %.1f s", sorted(set(warm_up_tokens)), time.perf_counter() - started)
    return model


def _one_causal_sequence(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The warm-up's attention: the packed row as one sequence (the halves' shapes do not depend on what attends)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
