"""The ``compile`` engine: ``torch.compile`` of the (cast) model, warmed up at start-up so the compilation is paid (and
measured) there; Inductor's kernels are cached on disk under ``ENGINE_CACHE_DIR/inductor``, Dynamo's tracing is not."""

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
    """``reduce-overhead`` (CUDA graphs: one launch per step) on CUDA; ``default`` (Inductor's fused C++) on the CPU."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def build_compiled(model: DecoderModel, precision: str, warmup_batch: int = 2) -> TorchModuleEngine:
    """``torch.compile(dynamic=True)`` of the (cast) model, warmed up at batch 1 and ``warmup_batch``, padded or not (the
    shapes Dynamo specializes on); raises :class:`EngineUnavailable` without a C++ compiler or a compiled graph."""
    if not compiler_available():
        raise EngineUnavailable("torch.compile needs a C++ compiler on the CPU (none found on PATH)")
    _check_16bit_supported(precision, model.device)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ENGINE_CACHE_DIR / "inductor"))
    _allow_enough_recompiles()
    started = time.perf_counter()
    graphs_before = _compiled_graphs()
    base = model if precision == "fp32" else cast_model(model, precision, fuse=False)  # Inductor fuses on its own
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
    """Start Dynamo afresh (engines built earlier recompile if called again) and raise its recompile limits, past which
    it silently runs the forward eagerly."""
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
