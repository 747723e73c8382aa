"""The ``onnxruntime`` engine: the model exported to two ONNX graphs and run by ONNX Runtime.

Prefill and decode graphs (past keys and values in, the new ones out) run with the graph optimizer on; int8 by
``quantize_dynamic``. Artifacts live in the engine cache, keyed by :func:`weights_fingerprint`."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from chapters.ch05_inference_engine.engine import ConversionReport, Engine, EngineUnavailable
from shared.model import DecoderModel, KVCache, ModelConfig
from shared.paths import ENGINE_CACHE_DIR, REPO_ROOT

def onnxruntime_missing_reason() -> str | None:
    missing = [name for name in ("onnxruntime", "onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (pip install onnxruntime onnx onnxscript; the `engines` extra)"
    return None


class _GraphCache:
    """The KV cache the model sees while it is exported: past keys/values are graph inputs, the new ones graph outputs."""

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

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.past[layer]

    def advance(self, n_tokens: int) -> None:
        pass


class _ExportedStep(nn.Module):
    """The model's forward with the cache turned inside out: ``(ids, positions, mask, *past) -> (logits, *new kv)``;
    ``logits`` is (B, V) for the last position; new keys/values are (B, H_kv, T, D), layer by layer, key then value."""

    def __init__(self, model: DecoderModel) -> None:
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


def weights_fingerprint(model: DecoderModel) -> str:
    """A short hash of the configuration and every weight: the cache key of converted artifacts."""
    digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def export_onnx(model: DecoderModel, directory: Path) -> tuple[Path, Path]:
    """Write ``prefill.onnx`` and ``decode.onnx`` (fp32) for ``model`` into ``directory``; returns their paths. Batch,
    prompt and past lengths are symbolic; decode takes one token per row and past keys and values as (B, H_kv, P, D)."""
    config = model.config
    n_layer, kv_heads, head_dim = config.n_layer, config.kv_heads, config.head_dim
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
    past = tuple(torch.zeros((2, kv_heads, past_len, head_dim)) for _ in range(2 * n_layer))
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
    """Two ONNX Runtime sessions (prefill, decode) over any :class:`shared.model.KVCache`, which keeps owning all KV memory:
    the past is read with ``cache.read`` (a dense copy per layer and step), the new keys and values stored with ``update``."""

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
        for layer in range(self.config.n_layer):
            key, value = cache.read(layer)
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
    """Operator histogram of an ONNX file, most frequent first."""
    import onnx
    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def build_onnxruntime(model: DecoderModel, precision: str, cache_dir: Path = ENGINE_CACHE_DIR) -> OnnxRuntimeEngine:
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
        artifact_paths=[str(p.relative_to(REPO_ROOT)) if p.is_relative_to(REPO_ROOT) else str(p) for p in paths],
        from_cache=from_cache,
        notes=notes,
    )
    return OnnxRuntimeEngine(precision, prefill_session, decode_session, model.config, model.device, report)


def _write_atomically(target: Path, write) -> None:
    """``write(folder)`` into a temporary sibling renamed to ``target``, so no half-written artifact is ever trusted."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if target.exists():
        shutil.rmtree(tmp)  # someone else finished first; theirs is as good as ours
        return
    tmp.rename(target)
