"""The ``tensorrt`` engine: Torch-TensorRT through its ``torch.compile`` backend, on an NVIDIA GPU with ``torch_tensorrt``;
elsewhere :func:`tensorrt_missing_reason` says why, and the engine is never faked."""

from __future__ import annotations

import importlib.util
import time

import torch

from chapters.ch05_inference_engine.engine import (
    TORCH_DTYPES,
    ConversionReport,
    EngineUnavailable,
    TorchModuleEngine,
    _activation_dtype,
    cast_model,
    warm_up,
)
from shared.model import DecoderModel

def tensorrt_missing_reason(device: torch.device) -> str | None:
    """None when Torch-TensorRT can run here; else the reason, in words."""
    if importlib.util.find_spec("torch_tensorrt") is None:
        return ("torch_tensorrt is not installed: TensorRT is NVIDIA's GPU-only engine and needs a CUDA build of "
                f"torch (here: torch {torch.__version__}) and an NVIDIA GPU")
    if device.type != "cuda":
        return "TensorRT builds engines for NVIDIA GPUs only; the model is on the CPU"
    return None


def build_tensorrt(model: DecoderModel, precision: str) -> TorchModuleEngine:
    """Torch-TensorRT through its ``torch.compile`` backend, warmed up (the builds) here; raises :class:`EngineUnavailable`
    where it cannot run and for int8. The result belongs to this GPU model and TensorRT version."""
    reason = tensorrt_missing_reason(model.device)
    if reason:
        raise EngineUnavailable(reason)
    if precision == "int8":
        raise EngineUnavailable("TensorRT int8 needs calibration data or a quantized (Q/DQ) model; not built here")
    import torch_tensorrt  # noqa: F401  (registers the "tensorrt" backend)
    started = time.perf_counter()
    base = model if precision == "fp32" else cast_model(model, precision)
    options = {"enabled_precisions": {TORCH_DTYPES[precision]}, "min_block_size": 1}
    compiled = torch.compile(base, backend="tensorrt", dynamic=True, options=options)
    engine = TorchModuleEngine("tensorrt", precision, compiled, model.config, model.device,
                               _activation_dtype(precision, model.device),
                               ConversionReport())
    for batch in (1, 2):
        for padded in (False, True):
            warm_up(engine, batch, padded)
    engine.conversion = ConversionReport(seconds=time.perf_counter() - started,
                                         notes=["torch.compile(backend='tensorrt'); seconds include the engine builds"])
    return engine
