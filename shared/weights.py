"""Where a model's weights come from: ``default``, ``dummy``, a safetensors file, or a Hugging Face GPT-2 directory.

Only safetensors is ever read: ``torch.load`` unpickles, and unpickling an untrusted file runs its code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.model import GPT, PRESETS, ModelConfig, init_weights
from shared.tokenizer import ByteTokenizer, Tokenizer, load_hf_tokenizer

DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "tiny-default.safetensors"
_CONFIG_KEY = "serving_from_scratch.config"
# Hugging Face's GPT-2 stores these as Conv1D, (in, out): transposed relative to nn.Linear.
_HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Tokenizer
    source: str  # what was loaded, for logs and benchmark records

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


def _load_own_safetensors(path: Path, preset: str) -> GPT:
    meta = _read_metadata(path)
    config = ModelConfig(**json.loads(meta[_CONFIG_KEY])) if _CONFIG_KEY in meta else PRESETS[preset]
    model = GPT(config)
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


def load_model(
    weights: str = "default",
    preset: str = "tiny",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LoadedModel:
    """Build the model in eval mode on ``device``.

    ``weights``: ``default`` (the embedded trained tiny model), ``dummy`` (seeded random init of
    ``preset``, for pure speed work), a ``.safetensors`` path, or a Hugging Face GPT-2 directory.
    """
    tokenizer: Tokenizer = ByteTokenizer()
    if weights == "default":
        if not DEFAULT_WEIGHTS.exists():
            raise FileNotFoundError(f"{DEFAULT_WEIGHTS} is missing: run `make model` to train it")
        model, source = _load_own_safetensors(DEFAULT_WEIGHTS, "tiny"), f"default:{DEFAULT_WEIGHTS.name}"
    elif weights == "dummy":
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
        model, source = init_weights(GPT(PRESETS[preset]), seed), f"dummy:{preset}:seed{seed}"
        if model.config.vocab_size != ByteTokenizer.vocab_size:
            tokenizer = _NoTextTokenizer(model.config.vocab_size)
    else:
        path = Path(weights)
        if path.is_dir():
            model, source = load_hf_gpt2(path), f"hf:{path}"
            tokenizer = load_hf_tokenizer(path, model.config.vocab_size)
        elif path.suffix == ".safetensors" and path.exists():
            model, source = _load_own_safetensors(path, preset), f"file:{path}"
        else:
            raise ValueError(f"--weights {weights!r}: expected default, dummy, a .safetensors file or a GPT-2 directory")
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source)


class _NoTextTokenizer:
    """For dummy weights of a non-byte vocabulary: ids only; text is shown as ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pad_id = 0

    def encode(self, text: str) -> list[int]:
        raise ValueError("this model has dummy weights and no tokenizer: send input_ids, not a prompt")

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))
