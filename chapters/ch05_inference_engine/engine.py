"""Chapter 5's idea: the same model, run by an inference engine, at a chosen precision.

An engine offers the model's two steps (:class:`shared.model.StepModel`), so chapter 3's step loop and chapter 4's runner
take it in the model's place. This module holds the interface, the eager engine and the precision casts; the other engines
(:data:`ENGINES`) live in modules that import it.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from chapters.ch03_dynamic_batching.batched_generation import batched_greedy
from chapters.ch05_inference_engine.bf16_matmul import NEVER, with_bf16_matmuls
from chapters.ch05_inference_engine.fused_blocks import with_fused_blocks
from shared.model import DecoderModel, KVCache, ModelConfig

ENGINES = ("eager", "compile", "onnxruntime", "tensorrt", "cudagraph")
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class EngineUnavailable(RuntimeError):
    """This engine (or this engine at this precision) cannot run on this machine; ``str()`` says why."""


@dataclass
class ConversionReport:
    """What it cost to turn the trained model into this engine."""
    seconds: float = 0.0  # wall time of the conversion (export, quantization, compilation warm-up)
    artifact_bytes: int | None = None  # size of what was written (ONNX files), None when nothing is
    artifact_paths: list[str] = field(default_factory=list)
    from_cache: bool = False  # the artifact was already in the engine cache: ``seconds`` is only the load
    notes: list[str] = field(default_factory=list)  # what was done, and what the optimizer fused

    def to_dict(self) -> dict:
        return asdict(self)


class Engine:
    """An inference engine: the model's two steps (:class:`shared.model.StepModel`), run another way.

    Both return float32 logits (B, V) of each row's last position; a prefill with ``cache=None`` discards its keys and
    values. ``dtype``, of activations and stored keys and values, is the one a KV cache or pool for this engine must use."""
    name: str = "?"
    precision: str = "fp32"

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, conversion: ConversionReport) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.conversion = conversion

    @property
    def label(self) -> str:
        return f"{self.name}/{self.precision}"

    @property
    def exact(self) -> bool:
        """Whether the engine promises the oracle's greedy tokens (fp32 only)."""
        return self.precision == "fp32"

    def prefill(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        """Logits (B, V) after the prompt; stores the prompt's keys and values in ``cache``."""
        raise NotImplementedError

    def decode(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache) -> Tensor:
        """Logits (B, V) after one more token per row; ``cache`` holds everything before it."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"engine": self.name, "precision": self.precision, "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "conversion": self.conversion.to_dict()}


class TorchModuleEngine(Engine):
    """An engine that is a PyTorch module with the model's forward (eager, compiled, TensorRT): both steps call it."""

    def __init__(self, name: str, precision: str, module: nn.Module | object, config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, conversion: ConversionReport) -> None:
        super().__init__(config, device, dtype, conversion)
        self.name, self.precision = name, precision
        self.module = module

    def _step(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        logits = self.module(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, last_token_only=True)
        return logits[:, -1, :].float()

    prefill = _step
    decode = _step


def torchao_missing_reason() -> str | None:
    """None when torchao (PyTorch's maintained quantization library) imports; else why not."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao; the `engines` extra)"
    return None


def cast_model(model: DecoderModel, precision: str, fuse: bool = True) -> DecoderModel:
    """A copy of ``model`` at ``precision``; the original is never touched. Raises :class:`EngineUnavailable`.

    fp16 / bf16: every weight cast (bf16 on the CPU: only the big products, :func:`with_bf16_matmuls`, and a Llama's
    element-wise work around them fused, :func:`with_fused_blocks`, unless not ``fuse``). int8: torchao's
    ``quantize_`` on the blocks' linear layers, activations per row on the CPU, weights only on CUDA (decode there is bound
    by reading weights); the embedding, the norms and the output layer stay fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    converted = copy.deepcopy(model)
    if precision == "bf16" and model.device.type == "cpu":
        return with_fused_blocks(with_bf16_matmuls(converted)) if fuse else with_bf16_matmuls(converted)
    if precision in TORCH_DTYPES:
        return converted.to(TORCH_DTYPES[precision]).eval()
    reason = torchao_missing_reason()
    if reason:
        raise EngineUnavailable(reason)
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )
    config = Int8WeightOnlyConfig() if model.device.type == "cuda" else Int8DynamicActivationInt8WeightConfig()
    for block in converted.blocks:
        quantize_(block, config)
    return converted.eval()


def _check_16bit_supported(precision: str, device: torch.device) -> None:
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise EngineUnavailable("this GPU has no bf16 support (needs compute capability 8.0 or newer)")


def build_eager(model: DecoderModel, precision: str) -> TorchModuleEngine:
    _check_16bit_supported(precision, model.device)
    started = time.perf_counter()
    converted = model if precision == "fp32" else cast_model(model, precision)
    notes = {
        "fp32": ["the plain PyTorch model (chapter 4's path)"],
        "int8": ["torchao quantize_: " + ("Int8WeightOnlyConfig" if model.device.type == "cuda" else "Int8DynamicActivationInt8WeightConfig")],
    }.get(precision, [f"weights cast to {precision}"])
    tuning = getattr(converted, "bf16_tuning", None)
    if tuning:
        measured = ", ".join(f"{rows}: {fp32:.0f}/{bf16:.0f}" for rows, (fp32, bf16) in tuning["timings_us"].items())
        start = f"from {tuning['min_rows']} rows" if tuning["min_rows"] < NEVER else "never (bf16 lost at every size measured)"
        notes = [(f"bf16 matmuls (the blocks' and the output layer's) {start}, fp32 below and everywhere else "
                  f"(rows: fp32/bf16 microseconds on the widest layer: {measured})"),
                 converted.fusion_missing or "a Llama block's element-wise work in fused C passes (fused_block_ops.c)"]
    report = ConversionReport(seconds=time.perf_counter() - started, notes=notes)
    return TorchModuleEngine("eager", precision, converted, model.config, model.device,
                             _activation_dtype(precision, model.device), report)


def multiplies_in_bf16(engine: Engine) -> bool:
    """Whether ``engine`` computes any matrix product in bf16: a CPU bf16 engine whose start-up found bf16 slower at
    every size (:func:`with_bf16_matmuls`) computes exactly as fp32 eager."""
    if engine.precision != "bf16":
        return False
    tuning = getattr(getattr(engine, "module", None), "bf16_tuning", None)
    return tuning is None or tuning["min_rows"] < NEVER


def _activation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of activations and of the KV cache: fp32 for int8, and for bf16 on the CPU (only products are bf16)."""
    if precision == "bf16" and device.type == "cpu":
        return torch.float32
    return TORCH_DTYPES.get(precision, torch.float32)


@torch.no_grad()
def warm_up(engine: Engine, batch: int, padded: bool, prompt_len: int = 6, steps: int = 3) -> None:
    """A prefill and ``steps`` decode steps of ``batch`` rows through chapter 3's step loop, the first row left-padded or not."""
    generator = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, engine.config.vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(batch)]
    if padded:
        prompts[0] = prompts[0][2:]
    batched_greedy(engine, prompts, [steps] * batch, pad_id=0)
