"""Chapter 5's idea: the same model, run by an inference engine, at a chosen precision.

An **engine** turns "these new tokens, this KV cache" into next-token logits through the same two
steps as the model (:class:`shared.model.StepModel`), so chapter 3's step loop and chapter 4's
pool-backed runner take an engine wherever they took the model, and nothing else changes:

- ``prefill(input_ids, ...)``: the whole (left-padded) prompt, nothing cached yet;
- ``decode(input_ids, ...)``: one new token per row, everything before it in the cache.

This file holds the interface every engine implements, the eager engine and how a model is cast to
another precision. The other engines live in their own modules (``compiled_engine``,
``onnx_engine``, ``tensorrt_engine``), bf16 matrix products on the CPU in ``bf16_matmul``, and the
rule that picks the default engine in ``engines``: each imports this file, never the other way.

==============  =============================================================================
``eager``       the plain PyTorch model, chapter 4's path. fp32 / fp16 / bf16 by casting the
                weights (bf16 on a CPU: only the big matrix products, :mod:`bf16_matmul`);
                int8 by torchao's dynamic quantization (int8 weights, activations quantized
                per token at run time; weight-only int8 on CUDA).
``compile``     ``torch.compile``: TorchDynamo captures the forward into graphs, TorchInductor
                generates fused kernels (C++/OpenMP on the CPU, Triton on CUDA).
``onnxruntime`` two exported ONNX graphs (prefill, and decode with past keys/values as inputs)
                run by ONNX Runtime with its graph optimizer on; int8 by its dynamic quantization.
``tensorrt``    Torch-TensorRT where it imports and a CUDA GPU is present; otherwise
                unavailable, with the reason. Never faked.
``cudagraph``   the decode step recorded as CUDA graphs over static buffers (bucketed batch
                sizes, keys and values in one pool range), replayed each step; prefill eager.
                CUDA only (``cudagraph_engine``).
==============  =============================================================================

An engine that cannot run here raises :class:`EngineUnavailable` with the reason; callers report it.
Conversion cost (seconds, artifact bytes, whether the artifact came from the cache) is recorded on
every engine in :class:`ConversionReport`.
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


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------


class Engine:
    """An inference engine: the model's two steps (:class:`shared.model.StepModel`), run another way.

    ``prefill`` and ``decode`` return float32 logits of each row's LAST position, shape (B, V)
    (generation needs no other position, and the exported graphs compute no other). ``cache``
    follows :class:`shared.model.KVCache`; a prefill with ``cache=None`` throws its keys and values
    away (what the accuracy measurement needs). ``dtype`` is the dtype of activations and of the keys
    and values the engine stores: a KV cache or pool for this engine must use it.
    """

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
        """fp32 engines promise the oracle's greedy tokens; reduced precisions a measured tolerance."""
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
    """An engine that is a PyTorch module with the model's forward: eager, compiled, or TensorRT-compiled.

    Both steps call the module's forward (a compiled module is compiled there), last position only.
    """

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


# ---------------------------------------------------------------------------------------------
# Precision: the same weights, fewer bits
# ---------------------------------------------------------------------------------------------


def torchao_missing_reason() -> str | None:
    """None when torchao (PyTorch's maintained quantization library) imports; else why not."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install torchao; the `engines` extra)"
    return None


def cast_model(model: DecoderModel, precision: str) -> DecoderModel:
    """A copy of ``model`` at ``precision``; the original is never touched.

    fp16 / bf16: every weight cast, so activations and the KV cache are 16-bit too. Except bf16 on
    the CPU: only the big matrix products run in bf16 (:func:`with_bf16_matmuls`), the rest in fp32.
    int8: torchao's ``quantize_`` on every ``nn.Linear`` of the blocks (the embedding, the norms and
    the output layer, tied or not, stay fp32: the last decides the argmax). On the CPU: ``Int8DynamicActivationInt8WeightConfig`` (weights int8
    per channel, each activation row quantized at run time, int8 x int8 matmuls). On CUDA:
    ``Int8WeightOnlyConfig`` (weights int8, dequantized inside the matmul; decode on a GPU is
    bound by reading weights, so halving their bytes is what pays there).

    Why torchao and not ``torch.ao.quantization.quantize_dynamic``: torch 2.13 still ships the latter,
    but every call warns that it is deprecated and points to torchao's ``quantize_``; a lesson
    should teach the maintained API.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    converted = copy.deepcopy(model)
    if precision == "bf16" and model.device.type == "cpu":
        return with_bf16_matmuls(converted)
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


# ---------------------------------------------------------------------------------------------
# eager
# ---------------------------------------------------------------------------------------------


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
        notes = [(f"bf16 matmuls {start}, fp32 below and everywhere else "
                  f"(rows: fp32/bf16 microseconds on the widest layer: {measured})")]
    report = ConversionReport(seconds=time.perf_counter() - started, notes=notes)
    return TorchModuleEngine("eager", precision, converted, model.config, model.device,
                             _activation_dtype(precision, model.device), report)


def multiplies_in_bf16(engine: Engine) -> bool:
    """Whether ``engine`` computes any matrix product in bf16.

    A bf16 engine on a CPU multiplies in bf16 only from the row count its start-up measured
    (:func:`with_bf16_matmuls`); where bf16 lost at every size measured (a CPU without bf16
    instructions), none at all: it then computes exactly as fp32 eager does, under another name.
    """
    if engine.precision != "bf16":
        return False
    tuning = getattr(getattr(engine, "module", None), "bf16_tuning", None)
    return tuning is None or tuning["min_rows"] < NEVER


def _activation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of activations and of the KV cache: int8 quantizes weights only, and bf16 on the CPU
    multiplies in bf16 but keeps everything else fp32 (:class:`Bf16MatmulLinear`)."""
    if precision == "bf16" and device.type == "cpu":
        return torch.float32
    return TORCH_DTYPES.get(precision, torch.float32)


@torch.no_grad()
def warm_up(engine: Engine, batch: int, padded: bool, prompt_len: int = 6, steps: int = 3) -> None:
    """Drive ``engine`` through chapter 3's step loop: a prefill and a few decode steps, with left
    padding (``padded``: the first row's prompt two tokens shorter) or without."""
    generator = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, engine.config.vocab_size, (prompt_len,), generator=generator).tolist() for _ in range(batch)]
    if padded:
        prompts[0] = prompts[0][2:]
    batched_greedy(engine, prompts, [steps] * batch, pad_id=0)
