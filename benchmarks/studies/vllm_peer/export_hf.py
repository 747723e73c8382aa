"""Write the project's model as a Hugging Face GPT-2 directory, so another server serves the same weights.

A peer server (vLLM's CPU backend) loads models the Hugging Face way: a directory with ``config.json``,
``model.safetensors`` under GPT-2's parameter names, and tokenizer files. This writes one from any
model :func:`shared.weights.load_model` loads (the embedded default by default):

- ``config.json``: GPT-2's fields for the model's shape (tanh GELU is GPT-2's ``gelu_new``; input and
  output embeddings tied, so no ``lm_head.weight`` is stored, as Hugging Face saves GPT-2 itself);
- ``model.safetensors``: the float32 weights under ``transformer.*`` names, the four projections
  transposed, since GPT-2 keeps them as ``Conv1D`` (in, out) where ``nn.Linear`` keeps (out, in);
- the byte tokenizer as a GPT-2 byte-level BPE with no merges: every byte is its own token with the
  byte's value as its id, and ``<|endoftext|>`` / ``<|pad|>`` the two special ids after them, so
  ids round-trip through either tokenizer (``tokenizer.json`` for the fast tokenizers library,
  ``vocab.json`` + ``merges.txt`` for the slow one, ``tokenizer_config.json`` naming the class).

:func:`shared.weights.load_hf_gpt2` reads the same layout back, which the tests use as one oracle
(the exact weights); Hugging Face's ``GPT2LMHeadModel`` is the other (the oracle's greedy tokens).

    python -m benchmarks.studies.vllm_peer.export_hf --out .cache/vllm-peer/tiny-default-hf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model import GPT
from shared.paths import REPO_ROOT
from shared.tokenizer import BYTE_VOCAB, SPECIAL_TOKENS, ByteTokenizer
from shared.weights import load_model

DEFAULT_EXPORT_DIR = REPO_ROOT / ".cache" / "vllm-peer" / "tiny-default-hf"
# The four projections GPT-2 stores as Conv1D, (in, out); ours are nn.Linear, (out, in).
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_config(model: GPT) -> dict:
    """``config.json`` for ``model``'s shape, as ``transformers.GPT2Config`` spells it."""
    config = model.config
    eos_id = ByteTokenizer.eos_id
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_ctx,
        "n_ctx": config.n_ctx,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # GPT-2's default: 4 * n_embd, as shared.model.MLP
        "activation_function": "gelu_new",  # the tanh approximation, shared.model's GELU
        "layer_norm_epsilon": config.layer_norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,  # GPT-2 uses its one special token for both, as the corpus separates documents
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def gpt2_state(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under GPT-2's names, Conv1D ones transposed, float32, contiguous (safetensors needs it)."""
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to(device="cpu", dtype=torch.float32)
        state[f"transformer.{name}"] = (tensor.t() if name.endswith(CONV1D_SUFFIXES) else tensor).contiguous()
    return state


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level BPE writes each byte as one of these characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_vocab() -> dict[str, int]:
    """Each byte's character (GPT-2's table) -> the byte's value, then the special tokens -> their ids."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    assert len(vocab) == BYTE_VOCAB
    vocab.update({text: token_id for token_id, text in SPECIAL_TOKENS.items()})
    return vocab


def tokenizer_json(vocab: dict[str, int]) -> dict:
    """A ``tokenizers`` byte-level BPE with no merges over ``vocab``: one token per byte, ids = byte values."""
    specials = [{"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True} for token_id, text in sorted(SPECIAL_TOKENS.items())]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def write_tokenizer(directory: Path) -> None:
    """The byte tokenizer's files in ``directory``, for both the fast and the slow GPT-2 tokenizer."""
    vocab = byte_vocab()
    eos, pad = SPECIAL_TOKENS[ByteTokenizer.eos_id], SPECIAL_TOKENS[ByteTokenizer.pad_id]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab), ensure_ascii=False, indent=1))
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n")  # no merges: bytes stay single tokens
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": eos, "eos_token": eos, "unk_token": eos, "pad_token": pad}))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False,
        "bos_token": eos, "eos_token": eos, "unk_token": eos, "pad_token": pad,
        "model_max_length": None, "clean_up_tokenization_spaces": False,
    }, indent=1))


def export(out: Path, weights: str = "default") -> Path:
    """Write ``weights`` (anything :func:`shared.weights.load_model` takes) as a GPT-2 directory at ``out``; returns ``out``.

    Refuses a model whose vocabulary is not the byte tokenizer's (the tokenizer files would not fit it)."""
    model = load_model(weights).model
    if model.config.vocab_size != ByteTokenizer.vocab_size:
        raise ValueError(f"{weights}: vocabulary of {model.config.vocab_size}, not the byte tokenizer's {ByteTokenizer.vocab_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(gpt2_config(model), indent=1))
    save_file(gpt2_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.vllm_peer.export_hf", description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="default", help="what shared.weights.load_model loads (default: the embedded model)")
    parser.add_argument("--out", type=Path, default=DEFAULT_EXPORT_DIR)
    args = parser.parse_args(argv)
    print(export(args.out, args.weights))


if __name__ == "__main__":
    main()
