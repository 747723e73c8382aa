"""Chapter 5's idea: the same model, run by different inference engines at different precisions.

An **engine** here is anything that turns "these new tokens, this KV cache" into next-token logits.
Every engine has the model's own call signature (``engine(input_ids, position_ids=...,
attention_mask=..., cache=..., last_token_only=True)``) plus ``config``, ``device`` and ``dtype``, so
chapter 3's batched generation and chapter 4's pool-backed runner take an engine wherever they took
the model, and nothing else changes. Under the signature there are two steps:

- ``prefill(input_ids, ...)``: the whole (left-padded) prompt, nothing cached yet;
- ``decode(input_ids, ...)``: one new token per row, everything before it in the cache.

The engines:

==============  =============================================================================
``eager``       the plain PyTorch model, chapter 4's path. fp32 / fp16 / bf16 by casting the
                weights; int8 by torchao's dynamic quantization (int8 weights, activations
                quantized per token at run time; weight-only int8 on CUDA).
``compile``     ``torch.compile``: TorchDynamo captures the Python forward into graphs and
                TorchInductor generates fused kernels for them (C++/OpenMP on the CPU, Triton on
                CUDA, where ``mode="reduce-overhead"`` also replays CUDA graphs). Compilation
                happens at the first calls of each new shape family: that is its conversion cost.
``onnxruntime`` the model exported with ``torch.onnx.export`` into two ONNX graphs (prefill, and
                decode with past keys/values as inputs), run by ONNX Runtime with its graph
                optimizer on (fusions). CPU execution provider; CUDA provider where present. int8
                by ``onnxruntime.quantization.quantize_dynamic``.
``tensorrt``    Torch-TensorRT (``torch.compile(backend="tensorrt")``) where it imports and a CUDA
                GPU is present; otherwise unavailable, with the reason. Never faked.
==============  =============================================================================

An engine that cannot run here raises :class:`EngineUnavailable` with the reason; callers report it.
Conversion cost (seconds, artifact bytes, whether the artifact came from the cache) is recorded on
every engine in :class:`ConversionReport`. Artifacts live under ``.cache/engines/`` (gitignored),
keyed by a fingerprint of the weights, so a second start reuses them.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model import GPT, KVCache, ModelConfig

ENGINES = ("eager", "compile", "onnxruntime", "tensorrt")
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("SFS_ENGINE_CACHE", PROJECT_ROOT / ".cache" / "engines"))


class EngineUnavailable(RuntimeError):
    """This engine (or this engine at this precision) cannot run on this machine; ``str()`` says why."""


@dataclass
class ConversionReport:
    """What it cost to turn the trained model into this engine."""

    seconds: float = 0.0  # wall time of the conversion (export, quantization, compilation warm-up)
    artifact_bytes: int | None = None  # size of what was written (ONNX files), None when nothing is
    artifact_paths: list[str] = field(default_factory=list)
    from_cache: bool = False  # the artifact was already in CACHE_DIR: ``seconds`` is only the load
    notes: list[str] = field(default_factory=list)  # what was done, and what the optimizer fused

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------


class Engine:
    """An inference engine with the model's call signature.

    Contract of ``__call__``: like ``GPT.forward(..., last_token_only=True)``: logits of the LAST
    position only, shape (B, 1, V), float32, whatever ``last_token_only`` says (generation needs no
    other position, and the exported graphs compute no other). ``cache`` follows
    :class:`shared.model.KVCache`; with ``cache=None`` the call is a prefill whose keys and values are
    thrown away (what :func:`shared.corpus.evaluate` needs). ``dtype`` is the dtype of activations and
    of the keys and values the engine stores: a KV cache or pool for this engine must use it.
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

    @torch.no_grad()
    def __call__(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        last_token_only: bool = True,
    ) -> Tensor:
        past = cache.seq_len if cache is not None else 0
        if past + input_ids.shape[1] > self.config.n_ctx:
            raise ValueError(f"sequence of {past + input_ids.shape[1]} tokens exceeds the context of {self.config.n_ctx}")
        if past == 0:
            logits = self.prefill(input_ids, position_ids, attention_mask, cache)
        else:
            logits = self.decode(input_ids, position_ids, attention_mask, cache)
        return logits[:, None, :]

    def describe(self) -> dict:
        return {"engine": self.name, "precision": self.precision, "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "conversion": self.conversion.to_dict()}


class TorchModuleEngine(Engine):
    """An engine that is a PyTorch module with GPT's forward: eager, compiled, or TensorRT-compiled."""

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


def cast_model(model: GPT, precision: str) -> GPT:
    """A copy of ``model`` at ``precision``; the original is never touched.

    fp16 / bf16: every weight cast, so activations and the KV cache are 16-bit too. Except bf16 on
    the CPU: only the big matrix products run in bf16 (:func:`with_bf16_matmuls`), the rest in fp32.
    int8: torchao's ``quantize_`` on every ``nn.Linear`` (the tied embedding / output projection and
    the LayerNorms stay fp32). On the CPU: ``Int8DynamicActivationInt8WeightConfig`` (weights int8
    per channel, each activation row quantized at run time, int8 x int8 matmuls). On CUDA:
    ``Int8WeightOnlyConfig`` (weights int8, dequantized inside the matmul; decode on a GPU is
    bound by reading weights, so halving their bytes is what pays there). Untested here: no GPU.

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
    quantize_(converted, config)
    return converted.eval()


NEVER = 2**62  # a row count no call reaches: bf16 never used


class Bf16MatmulLinear(nn.Module):
    """A linear layer whose large calls multiply in bf16 and whose small ones stay fp32.

    Input and output are fp32. A call with at least ``min_rows`` rows (tokens) rounds its input to
    bf16 and multiplies by a bf16 copy of the weights (the CPU's bf16 dot-product instructions,
    accumulating in fp32); a smaller call uses the fp32 weights, because there the bf16 kernel's
    fixed cost is larger than the arithmetic it saves. This is what CPU inference stacks do with
    bf16 (autocast, oneDNN): matrix products in bf16, LayerNorm, softmax and the KV cache in fp32.
    """

    def __init__(self, linear: nn.Linear, min_rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.min_rows = linear.in_features, linear.out_features, min_rows
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.register_buffer("weight_bf16", self.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias_bf16", None if self.bias is None else self.bias.detach().to(torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() >= self.min_rows * self.in_features:
            return _bf16_linear(x, self.weight_bf16, self.bias_bf16)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bf16 from {self.min_rows} rows"


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and oneDNN will use it.

    Without those instructions bf16 is emulated and slower than fp32, so it would not pay.
    """
    onednn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # private: absent in some builds
    if not (torch.backends.mkldnn.is_available() and onednn_bf16 is not None and onednn_bf16()):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_crossover_rows(
    linear: nn.Linear, candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 30
) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """Measure where bf16 starts to beat fp32 for this layer's shape: kernel autotuning by hand.

    For each candidate row count, time the fp32 and the bf16 product (median of ``repeats``) and
    pick with :func:`crossover_from_timings`. Returns the crossover and the timings in
    microseconds, ``{rows: (fp32, bf16)}``, which the conversion report keeps.
    """
    weight = linear.weight.detach().float()
    bias = None if linear.bias is None else linear.bias.detach().float()
    weight16, bias16 = weight.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16)
    timings: dict[int, tuple[float, float]] = {}
    with torch.no_grad():
        for rows in candidates:
            x = torch.randn(rows, linear.in_features)
            fp32 = _median_us(partial(F.linear, x, weight, bias), repeats)
            bf16 = _median_us(partial(_bf16_linear, x, weight16, bias16), repeats)
            timings[rows] = (fp32, bf16)
    return crossover_from_timings(timings), timings


def crossover_from_timings(timings: dict[int, tuple[float, float]]) -> int | None:
    """The smallest row count from which bf16 (second figure) is faster at every larger measured
    count (past the largest, bf16 only gets better: more arithmetic for the same fixed cost);
    None when bf16 loses even at the largest count (a CPU that emulates bf16)."""
    crossover = None
    for rows in sorted(timings, reverse=True):
        fp32, bf16 = timings[rows]
        if bf16 >= fp32:
            break
        crossover = rows
    return crossover


def _bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x.to(torch.bfloat16), weight, bias).float()


def _median_us(call, repeats: int) -> float:
    call()  # the first call pays oneDNN's one-off setup for this shape
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    return sorted(samples)[len(samples) // 2]


def with_bf16_matmuls(model: GPT, min_rows: int | None = None) -> GPT:
    """``model`` (changed in place) with every transformer-block linear layer a :class:`Bf16MatmulLinear`.

    ``min_rows=None`` measures the crossover on the widest layer (:func:`bf16_crossover_rows`) and
    records it on the model as ``bf16_tuning``; where bf16 never won, every product stays fp32 (and
    the notes say so). The embedding and the output projection tied to it stay fp32: the first is
    a lookup, the second decides the argmax.
    """
    timings: dict[int, tuple[float, float]] = {}
    if min_rows is None:
        measured, timings = bf16_crossover_rows(model.h[0].mlp.c_fc)
        min_rows = measured if measured is not None else NEVER
    for block in model.h:
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"), (block.mlp, "c_proj")):
            setattr(parent, name, Bf16MatmulLinear(getattr(parent, name), min_rows))
    model.bf16_tuning = {"min_rows": min_rows, "timings_us": timings}
    return model.eval()


def _check_16bit_supported(precision: str, device: torch.device) -> None:
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise EngineUnavailable("this GPU has no bf16 support (needs compute capability 8.0 or newer)")


# ---------------------------------------------------------------------------------------------
# eager and compile
# ---------------------------------------------------------------------------------------------


def build_eager(model: GPT, precision: str) -> TorchModuleEngine:
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


def _activation_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of activations and of the KV cache: int8 quantizes weights only, and bf16 on the CPU
    multiplies in bf16 but keeps everything else fp32 (:class:`Bf16MatmulLinear`)."""
    if precision == "bf16" and device.type == "cpu":
        return torch.float32
    return TORCH_DTYPES.get(precision, torch.float32)


def compile_mode(device: torch.device) -> str:
    """CUDA: ``reduce-overhead`` records CUDA graphs, so a decode step is one launch instead of
    hundreds. The CPU has no launch overhead to save that way: ``default`` (Inductor's fused C++)."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def build_compiled(model: GPT, precision: str, warmup_batch: int = 2) -> TorchModuleEngine:
    """``torch.compile`` of the (cast) model, warmed up so the compilation cost is paid and measured here.

    ``dynamic=True`` makes batch size and sequence length symbolic, so a new length does not
    recompile; Dynamo still specializes on sizes 0 and 1 and on the cache's Python state (first
    call vs later calls), so the warm-up runs a prefill and decode steps at batch 1 and at
    ``warmup_batch``, with and without a padding mask. Inductor's kernels are cached on disk under
    ``CACHE_DIR/inductor``, which makes a second start much cheaper (not free: Dynamo re-traces).
    """
    if not _compiler_available():
        raise EngineUnavailable("torch.compile needs a C++ compiler on the CPU (none found on PATH)")
    _check_16bit_supported(precision, model.device)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR / "inductor"))
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
            _warm_up(engine, batch, padded)
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
    GPT.forward and the blocks it calls, shared by every model instance), then silently falls back
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


def _compiler_available() -> bool:
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


@torch.no_grad()
def _warm_up(engine: Engine, batch: int, padded: bool, prompt_len: int = 6, steps: int = 3) -> None:
    """Drive ``engine`` through a prefill and a few decode steps, the way chapter 3 does."""
    from shared.model import DynamicKVCache

    device = engine.device
    ids = torch.randint(0, engine.config.vocab_size, (batch, prompt_len), device=device)
    mask = torch.ones((batch, prompt_len), dtype=torch.long, device=device)
    if padded:
        mask[0, :2] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicKVCache(engine.config.n_layer)
    for _ in range(steps):
        logits = engine(ids, position_ids=positions, attention_mask=mask if padded else None, cache=cache)
        ids = logits[:, -1, :].argmax(-1, keepdim=True)
        positions = positions[:, -1:] + 1
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)


# ---------------------------------------------------------------------------------------------
# TensorRT
# ---------------------------------------------------------------------------------------------


def tensorrt_missing_reason(device: torch.device) -> str | None:
    """None when Torch-TensorRT can run here; else the reason, in words."""
    if importlib.util.find_spec("torch_tensorrt") is None:
        return ("torch_tensorrt is not installed: TensorRT is NVIDIA's GPU-only engine and needs a CUDA build of "
                f"torch (here: torch {torch.__version__}) and an NVIDIA GPU")
    if device.type != "cuda":
        return "TensorRT builds engines for NVIDIA GPUs only; the model is on the CPU"
    return None


def build_tensorrt(model: GPT, precision: str) -> TorchModuleEngine:
    """Torch-TensorRT through its ``torch.compile`` backend. NOT exercised on the machine this was
    written on (no GPU); it exists so a GPU machine with ``torch_tensorrt`` gets the real thing.

    TensorRT picks, per layer, the fastest of its kernels by timing them on this GPU (kernel
    autotuning), fuses layers, and runs in the precisions it is allowed to use: the build is slow,
    and the result belongs to this GPU model and TensorRT version.
    """
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
            _warm_up(engine, batch, padded)
    engine.conversion = ConversionReport(seconds=time.perf_counter() - started,
                                         notes=["torch.compile(backend='tensorrt'); seconds include the engine builds"])
    return engine


# ---------------------------------------------------------------------------------------------
# ONNX Runtime
# ---------------------------------------------------------------------------------------------


def onnxruntime_missing_reason() -> str | None:
    missing = [name for name in ("onnxruntime", "onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (pip install onnxruntime onnx onnxscript; the `engines` extra)"
    return None


class _GraphCache:
    """The KV cache the model sees while it is being exported: past keys/values come in as graph
    inputs, the new ones go out as graph outputs. (Only used at export time.)"""

    def __init__(self, past: list[tuple[Tensor, Tensor]] | None, n_layer: int) -> None:
        self.past = past
        self.new: list[tuple[Tensor, Tensor] | None] = [None] * n_layer

    @property
    def seq_len(self) -> int:
        return 0 if self.past is None else self.past[0][0].shape[2]

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.new[layer] = (key, value)
        if self.past is None:
            return key, value
        past_key, past_value = self.past[layer]
        return torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)

    def advance(self, n_tokens: int) -> None:
        pass


class _ExportedStep(nn.Module):
    """GPT's forward with the cache turned inside out: ``(ids, positions, mask, *past) -> (logits, *new kv)``.

    ``logits`` is (B, V) for the last position; new keys/values are (B, H, T, D), layer by layer,
    key then value. The model's own forward runs unchanged: the graph is the lesson's model.
    """

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, *past_flat: Tensor) -> tuple[Tensor, ...]:
        n_layer = self.model.config.n_layer
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(n_layer)] if past_flat else None
        cache = _GraphCache(past, n_layer)
        logits = self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, last_token_only=True)
        outputs: list[Tensor] = [logits[:, -1, :]]
        for key, value in cache.new:
            outputs += [key, value]
        return tuple(outputs)


def _kv_names(prefix: str, n_layer: int) -> list[str]:
    return [f"{prefix}_{kind}_{layer}" for layer in range(n_layer) for kind in ("key", "value")]


def weights_fingerprint(model: GPT) -> str:
    """A short hash of the configuration and every weight: the cache key of converted artifacts."""
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def export_onnx(model: GPT, directory: Path) -> tuple[Path, Path]:
    """Write ``prefill.onnx`` and ``decode.onnx`` (fp32) for ``model`` into ``directory``.

    Uses the maintained exporter (``torch.onnx.export(dynamo=True)``, built on ``torch.export``;
    needs ``onnxscript``). Batch size, prompt length and past length are symbolic dimensions, so
    one pair of graphs serves every batch. The decode graph takes exactly one new token per row.
    """
    config = model.config
    n_layer, heads, head_dim = config.n_layer, config.n_head, config.head_dim
    cpu_model = copy.deepcopy(model).float().cpu().eval()
    step = _ExportedStep(cpu_model)
    batch_dim = torch.export.Dim("batch", min=1, max=4096)
    directory.mkdir(parents=True, exist_ok=True)
    prefill_path, decode_path = directory / "prefill.onnx", directory / "decode.onnx"

    # Prefill: a prompt of T tokens, nothing cached.
    prompt_dim = torch.export.Dim("prompt", min=1, max=config.n_ctx)
    example_len = 5
    ids = torch.zeros((2, example_len), dtype=torch.long)
    mask = torch.ones((2, example_len), dtype=torch.long)
    _export(step, (ids, mask.cumsum(1) - 1, mask), prefill_path,
            ["input_ids", "position_ids", "attention_mask"], ["logits", *_kv_names("new", n_layer)],
            ({0: batch_dim, 1: prompt_dim}, {0: batch_dim, 1: prompt_dim}, {0: batch_dim, 1: prompt_dim}))

    # Decode: one token per row, P positions cached (the mask covers P + 1).
    past_dim = torch.export.Dim("past", min=1, max=config.n_ctx - 1)
    past_len = 5
    past = tuple(torch.zeros((2, heads, past_len, head_dim)) for _ in range(2 * n_layer))
    ids = torch.zeros((2, 1), dtype=torch.long)
    mask = torch.ones((2, past_len + 1), dtype=torch.long)
    _export(step, (ids, torch.full((2, 1), past_len), mask, *past), decode_path,
            ["input_ids", "position_ids", "attention_mask", *_kv_names("past", n_layer)],
            ["logits", *_kv_names("new", n_layer)],
            # *past is one argument to the exporter: its shapes go in one nested tuple.
            ({0: batch_dim}, {0: batch_dim}, {0: batch_dim, 1: past_dim + 1}, tuple({0: batch_dim, 2: past_dim} for _ in past)))
    return prefill_path, decode_path


def _export(module: nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str], dynamic_shapes: tuple) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, input_names=input_names, output_names=output_names,
                          dynamic_shapes=dynamic_shapes, external_data=False, verbose=False)


def quantize_onnx_int8(source: Path, target: Path) -> None:
    """ONNX Runtime's dynamic quantization: MatMul weights stored int8, activations quantized per call."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


def onnx_providers(device: torch.device) -> list[str]:
    """CUDA's execution provider first when the model is on a GPU and ONNX Runtime has it; the CPU's always."""
    import onnxruntime as ort

    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _onnx_precision_reason(precision: str, device: torch.device) -> str | None:
    if precision in ("fp32", "int8"):
        return None
    if device.type == "cuda":
        return (f"{precision} ONNX graphs are not built here: the CUDA provider would need them converted "
                "(onnxconverter-common) and fed through IO binding; use compile or tensorrt for 16-bit on a GPU")
    return (f"ONNX Runtime's CPU execution provider has no {precision} kernels for most of this graph's operators "
            "(it computes in fp32 or int8); on a CPU its reduced precision is int8")


class OnnxRuntimeEngine(Engine):
    """Two ONNX Runtime sessions (prefill, decode) over any :class:`shared.model.KVCache`.

    How it uses the cache: the graphs take past keys/values as inputs and return only the NEW ones,
    which the engine stores with ``cache.update``. To read the past it calls ``cache.update`` with
    zero new positions, which the protocol answers with every stored key and value. So chapter 4's
    pool still owns all KV memory: ONNX Runtime reads the pool's views (one contiguous copy per
    layer and step, as ONNX Runtime wants dense inputs) and allocates only the new position's
    outputs and its own activations, from its own arena allocator (a memory pool of its own).
    """

    name = "onnxruntime"

    def __init__(self, precision: str, prefill_session, decode_session, config: ModelConfig,
                 device: torch.device, conversion: ConversionReport) -> None:
        super().__init__(config, device, torch.float32, conversion)
        self.precision = precision
        self._prefill = prefill_session
        self._decode = decode_session

    def prefill(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        feeds = self._token_feeds(input_ids, position_ids, attention_mask, past=0)
        return self._run(self._prefill, feeds, cache, input_ids.shape[1])

    def decode(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, cache: KVCache) -> Tensor:
        if input_ids.shape[1] != 1:
            raise ValueError("the decode graph takes exactly one new token per row")
        past = cache.seq_len
        feeds = self._token_feeds(input_ids, position_ids, attention_mask, past)
        for layer, (key, value) in enumerate(self._read_past(cache, input_ids.shape[0])):
            feeds[f"past_key_{layer}"] = key.float().cpu().contiguous().numpy()
            feeds[f"past_value_{layer}"] = value.float().cpu().contiguous().numpy()
        return self._run(self._decode, feeds, cache, 1)

    def _token_feeds(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, past: int) -> dict:
        batch, length = input_ids.shape
        if position_ids is None:  # unpadded rows: positions continue from the cache
            position_ids = torch.arange(past, past + length)[None, :].expand(batch, length)
        if attention_mask is None:  # no padding: every position is real (the graph always takes a mask)
            attention_mask = torch.ones((batch, past + length), dtype=torch.long)
        return {
            "input_ids": input_ids.cpu().long().numpy(),
            "position_ids": position_ids.cpu().long().expand(batch, length).contiguous().numpy(),
            "attention_mask": attention_mask.cpu().long().numpy(),
        }

    def _read_past(self, cache: KVCache, batch: int) -> list[tuple[Tensor, Tensor]]:
        """Every stored key and value, per layer: ``update`` with zero new positions returns them."""
        nothing = torch.empty((batch, self.config.n_head, 0, self.config.head_dim), dtype=self.dtype, device=self.device)
        return [cache.update(layer, nothing, nothing) for layer in range(self.config.n_layer)]

    def _run(self, session, feeds: dict, cache: KVCache | None, new_positions: int) -> Tensor:
        outputs = session.run(None, feeds)
        if cache is not None:
            for layer in range(self.config.n_layer):
                key, value = outputs[1 + 2 * layer], outputs[2 + 2 * layer]
                cache.update(layer, torch.from_numpy(key).to(self.device), torch.from_numpy(value).to(self.device))
            cache.advance(new_positions)
        return torch.from_numpy(outputs[0]).to(self.device)


def _session(path: Path, device: torch.device, optimized_path: Path | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # the fusions
    options.intra_op_num_threads = torch.get_num_threads()  # the same cores PyTorch gets: a fair race
    options.log_severity_level = 3
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)  # what the optimizer made of the graph
    return ort.InferenceSession(str(path), sess_options=options, providers=onnx_providers(device))


def count_onnx_ops(path: Path) -> dict[str, int]:
    """Operator histogram of an ONNX file: before/after fusion, for the lesson."""
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def build_onnxruntime(model: GPT, precision: str, cache_dir: Path = CACHE_DIR) -> OnnxRuntimeEngine:
    """Export (or reuse from ``cache_dir``) the two graphs, quantize for int8, open the sessions."""
    reason = onnxruntime_missing_reason() or _onnx_precision_reason(precision, model.device)
    if reason:
        raise EngineUnavailable(reason)
    started = time.perf_counter()
    directory = cache_dir / f"onnx-{weights_fingerprint(model)}"
    fp32_paths = (directory / "fp32" / "prefill.onnx", directory / "fp32" / "decode.onnx")
    from_cache = all(p.exists() for p in fp32_paths)
    notes: list[str] = []
    if not from_cache:
        _write_atomically(directory / "fp32", lambda tmp: export_onnx(model, tmp))
        notes.append("exported with torch.onnx.export(dynamo=True)")
    paths = fp32_paths
    if precision == "int8":
        paths = (directory / "int8" / "prefill.onnx", directory / "int8" / "decode.onnx")
        if not all(p.exists() for p in paths):
            from_cache = False

            def quantize_both(tmp: Path) -> None:
                for source in fp32_paths:
                    quantize_onnx_int8(source, tmp / source.name)

            _write_atomically(directory / "int8", quantize_both)
            notes.append("int8 by onnxruntime.quantization.quantize_dynamic (weights QInt8)")
    optimized = directory / precision / "decode.optimized.onnx"
    prefill_session = _session(paths[0], model.device)
    decode_session = _session(paths[1], model.device, optimized_path=optimized)
    before, after = count_onnx_ops(paths[1]), count_onnx_ops(optimized)
    notes.append(f"decode graph: {sum(before.values())} nodes exported, {sum(after.values())} after ONNX Runtime's "
                 f"optimizer; operators after: {json.dumps(after)}")
    report = ConversionReport(
        seconds=time.perf_counter() - started,
        artifact_bytes=sum(p.stat().st_size for p in paths),
        artifact_paths=[str(p.relative_to(PROJECT_ROOT)) if p.is_relative_to(PROJECT_ROOT) else str(p) for p in paths],
        from_cache=from_cache,
        notes=notes,
    )
    return OnnxRuntimeEngine(precision, prefill_session, decode_session, model.config, model.device, report)


def _write_atomically(target: Path, write) -> None:
    """Write into a temporary sibling folder and rename it into place, so a crash or a concurrent
    process never leaves a half-written artifact that a later run would trust."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if target.exists():
        shutil.rmtree(tmp)  # someone else finished first; theirs is as good as ours
        return
    tmp.rename(target)


# ---------------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------------


def unavailable_reason(engine: str, precision: str, device: torch.device) -> str | None:
    """Why ``engine`` at ``precision`` cannot run on ``device``, or None when it should.

    Cheap: imports and device checks only; building can still fail (and says why).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    if engine == "tensorrt":
        return tensorrt_missing_reason(device)
    if engine == "onnxruntime":
        return onnxruntime_missing_reason() or _onnx_precision_reason(precision, device)
    if engine == "compile" and not _compiler_available():
        return "torch.compile needs a C++ compiler on the CPU (none found on PATH)"
    if precision == "int8":
        return torchao_missing_reason()
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    return None


# What ``--engine auto`` picks, from the measurements in the README (trade-off table and harness runs).
# On the CPU, eager: under the harness's load (the server's own batches, 32-64 users) it served more
# than ONNX Runtime did (benchmarks/reference/cpu/ch05-onnxruntime.json); ONNX Runtime won only at
# batch 1 in the trade-off table, and torch.compile pays its compilation at EVERY start and lost at
# batch 32. On CUDA: TensorRT where installed, else eager. torch.compile with CUDA graphs is not
# chosen: with a KV cache that grows every step, each new (batch, length) records a new graph.
AUTO_PREFERENCE = {
    "cpu": ("eager",),
    "cuda": ("tensorrt", "eager"),
}


def auto_engine(device: torch.device, precision: str = "fp32") -> str:
    """The first engine of ``AUTO_PREFERENCE`` that is available at ``precision`` on ``device``."""
    for engine in AUTO_PREFERENCE.get(device.type, ("eager",)):
        if unavailable_reason(engine, precision, device) is None:
            return engine
    return "eager"


def auto_precision(device: torch.device) -> str:
    """The precision ``--precision auto`` picks: the fastest one that keeps the task accuracy within
    ``ACCURACY_TOLERANCE`` of fp32 and beats fp32 by ``MIN_SPEEDUP`` (the trade-off tables measure
    both, ``tradeoffs.fastest_within_tolerance`` applies the rule; the tests hold the accuracy).

    CPU: bf16 where the CPU multiplies in bf16 (AVX512-BF16 or AMX), else fp32 (fp16 has no
    arithmetic on most CPUs and was the slowest row). int8 is not chosen: it lost to bf16 at batch 32.
    CUDA: fp32. On the H200 the README reports, eager bf16 served 0.96x of fp32 and the tiny model's
    table ranked fp16/bf16 at 1.03x/0.95x: a GPU fed by eager PyTorch waits on Python and kernel
    launches, and fewer bits only pay once that overhead is gone (CUDA graphs, TensorRT).
    """
    if device.type == "cuda":
        return "fp32"
    return "bf16" if cpu_has_native_bf16() else "fp32"


ACCURACY_TOLERANCE = 0.02  # task accuracy a reduced precision may lose against fp32 (the 2 points)
# A faster row must beat fp32 eager by more than run-to-run noise (10 % here) before it is worth
# giving up the oracle's exact tokens.
MIN_SPEEDUP = 1.10


def build_engine(model: GPT, engine: str = "auto", precision: str = "auto") -> Engine:
    """The engine named ``engine`` at ``precision`` for ``model`` (``auto``: :func:`auto_engine`,
    :func:`auto_precision`). Raises :class:`EngineUnavailable` (with the reason) when it cannot run here.
    """
    if precision == "auto":
        precision = auto_precision(model.device)
    if engine == "auto":
        engine = auto_engine(model.device, precision)
    reason = unavailable_reason(engine, precision, model.device)
    if reason:
        raise EngineUnavailable(f"{engine}/{precision}: {reason}")
    builders = {"eager": build_eager, "compile": build_compiled, "onnxruntime": build_onnxruntime, "tensorrt": build_tensorrt}
    return builders[engine](model, precision)
