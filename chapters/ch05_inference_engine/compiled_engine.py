"""The ``compile`` engine: ``torch.compile`` of the (cast) model, warmed up at start-up.

TorchDynamo captures the Python forward into graphs and TorchInductor generates fused kernels for
them (C++/OpenMP on the CPU, Triton on CUDA, where ``mode="reduce-overhead"`` also replays CUDA
graphs). Compilation happens at the first calls of each new shape family: that is its conversion
cost, paid at every start (Inductor's kernels are cached on disk, Dynamo's tracing is not).
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from chapters.ch05_inference_engine.engine import (
    ConversionReport,
    EngineUnavailable,
    TorchModuleEngine,
    _activation_dtype,
    _check_16bit_supported,
    cast_model,
    warm_up,
)
from shared.model import DecoderModel
from shared.paths import ENGINE_CACHE_DIR

def compile_mode(device: torch.device) -> str:
    """CUDA: ``reduce-overhead`` records CUDA graphs, so a decode step is one launch instead of
    hundreds. The CPU has no launch overhead to save that way: ``default`` (Inductor's fused C++)."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def build_compiled(model: DecoderModel, precision: str, warmup_batch: int = 2) -> TorchModuleEngine:
    """``torch.compile`` of the (cast) model, warmed up so the compilation cost is paid and measured here.

    ``dynamic=True`` makes batch size and sequence length symbolic, so a new length does not
    recompile; Dynamo still specializes on sizes 0 and 1 and on the cache's Python state (first
    call vs later calls), so the warm-up runs a prefill and decode steps at batch 1 and at
    ``warmup_batch``, with and without a padding mask. Inductor's kernels are cached on disk under
    ``ENGINE_CACHE_DIR/inductor``, which makes a second start much cheaper (not free: Dynamo re-traces).
    """
    if not compiler_available():
        raise EngineUnavailable("torch.compile needs a C++ compiler on the CPU (none found on PATH)")
    _check_16bit_supported(precision, model.device)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ENGINE_CACHE_DIR / "inductor"))
    _allow_enough_recompiles()
    started = time.perf_counter()
    graphs_before = _compiled_graphs()
    base = model if precision == "fp32" else cast_model(model, precision)
    compiled = torch.compile(base, dynamic=True, mode=compile_mode(model.device))
    engine = TorchModuleEngine("compile", precision, compiled, model.config, model.device,
                               _activation_dtype(precision, model.device),
                               ConversionReport())
    for batch in sorted({1, warmup_batch}):
        for padded in (False, True):
            warm_up(engine, batch, padded)
    new_graphs = _compiled_graphs() - graphs_before
    if new_graphs == 0:  # Dynamo gave up and runs the Python code eagerly: do not call that "compiled"
        raise EngineUnavailable("torch.compile compiled no graph for this model (it would silently run eagerly)")
    engine.conversion = ConversionReport(
        seconds=time.perf_counter() - started,
        notes=[(f"torch.compile(dynamic=True, mode={compile_mode(model.device)!r}): {new_graphs} graphs compiled during"
                " the warm-up; seconds = Dynamo tracing + Inductor code generation")],
    )
    return engine


def _allow_enough_recompiles() -> None:
    """Start Dynamo afresh and let it keep enough versions of the forward.

    Dynamo keeps at most ``recompile_limit`` (default 8) compiled versions of one function (here
    the model's forward and the blocks it calls, shared by every model instance), then silently falls back
    to eager. The forward gets a version per cache type, first call or not, mask or not, batch 1 or
    more, and per model instance, which passes 8 quickly. ``reset`` forgets the versions of engines
    built earlier in this process (they recompile if called again); the server builds only one.
    """
    import torch._dynamo
    import torch._dynamo.config as dynamo_config

    torch._dynamo.reset()
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 1024)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def compiler_available() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None

