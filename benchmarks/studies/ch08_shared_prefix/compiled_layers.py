"""Tried, not served: each layer's two halves around attention compiled by TorchInductor, the passes between the products fused.

The step split replays a served step with these (``step_split.py --compiled-layers``); a served
chapter 8 ran with them by default at commit cf2a832 (``--compile-layers``) and measured against vLLM
(``peer-compiled-layers/``). The README beside this says what each showed and why it is not served.

On a CPU that multiplies bf16 natively the matrix products of a decode step are a minority of its time.
Between them, chapter 5's bf16 engine makes a pass over every activation for each of: two LayerNorms,
the GELU, two residual additions, and a cast to bf16 before each of the four products and back after.
Compiled with frozen weights (TorchInductor's ``freezing``), each half of a layer
(:meth:`shared.model.Block.qkv` before attention, :meth:`shared.model.Block.after_attention` after it)
becomes a few fused loops around oneDNN's products on prepacked weights, the GELU one of the products'
post-ops. Attention stays the backend's call between the halves: it reads a paged cache no compiler
sees. vLLM compiles its model the same way, in pieces around an opaque attention op.

:data:`RULE` (``--compile-layers auto``): on where the engine multiplies in bf16 on a CPU (its tokens
are already within chapter 5's tolerance rather than the oracle's), off at fp32, whose promise is the
oracle's exact tokens (a fused LayerNorm sums in another order and rounds differently), and off on a
GPU, where the decode steps are recorded as CUDA graphs instead (:mod:`~chapters.ch08_continuous_batching.fast.cuda_graphs`).
The token count is dynamic; a layer compiles once for one token, once for a few (below the bf16
crossover) and once for more, all at start-up (:func:`compile_layers` runs those shapes), and
TorchInductor keeps its kernels where every process on this machine finds them.
"""

from __future__ import annotations

import logging
import time

import torch

from chapters.ch05_inference_engine.engine import Engine, multiplies_in_bf16
from chapters.ch08_continuous_batching.fast.startup_cache import use_cache_for_compilers
from shared.model import GPT

log = logging.getLogger(__name__)

RULE = ("auto: on where the engine runs on a CPU and multiplies in bf16, off at fp32 (the oracle's exact tokens) "
        "and on a GPU (its steps are recorded as graphs instead, and this was measured on CPUs only)")
WARM_UP_TOKENS = (1, 2, 64)  # one token, a few (fp32 products below the crossover), many: every compiled variant


def compile_layers_here(setting: str, engine: Engine) -> bool:
    """The ``--compile-layers`` setting for ``engine``: :data:`RULE` for ``auto``."""
    return setting == "on" or (setting == "auto" and engine.device.type == "cpu" and multiplies_in_bf16(engine))


def compile_layers(model: GPT) -> None:
    """Replace every block's two halves by compiled ones (in place) and compile them now, for each token count
    of :data:`WARM_UP_TOKENS`; the block's ``forward`` calls them unchanged."""
    import torch._dynamo
    import torch._inductor.config

    started = time.perf_counter()
    use_cache_for_compilers()
    # one compiled variant per layer and token-count range: more than dynamo keeps by default for one function
    needed = (len(WARM_UP_TOKENS) + 1) * len(model.h)
    torch._dynamo.config.recompile_limit = max(getattr(torch._dynamo.config, "recompile_limit", 8), needed)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, needed)
    for block in model.h:
        block.qkv = torch.compile(block.qkv, dynamic=True)
        block.after_attention = torch.compile(block.after_attention, dynamic=True)
    width, heads, like = model.config.n_embd, model.config.n_head, {"device": model.device, "dtype": model.wte.weight.dtype}
    # Frozen weights are constants: prepacked for oneDNN, post-ops fused. The setting is read whenever a shape
    # or layout is compiled, at its first call, which may come in serving (attention's output is laid out as
    # the backend lays it out): so it is set for the process (torch.compile's options= did not reach it in 2.13).
    torch._inductor.config.freezing = True
    with torch.no_grad():
        for tokens in WARM_UP_TOKENS:
            x, y = torch.zeros(1, tokens, width, **like), torch.zeros(1, heads, tokens, width // heads, **like)
            for block in model.h:
                block.qkv(x)
                block.after_attention(x, y)
    log.info("compiled layers: %d layers' halves around attention compiled in %.1f s (%s)", len(model.h),
             time.perf_counter() - started, RULE)
