"""A Llama ``.gguf`` file read with llama.cpp's ``gguf``: its shape, its float32 state under Llama's names, its BPE tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.model import ModelConfig

GGUF_MAGIC = b"GGUF"
CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens (<|im_start|> ...)
# llama.cpp's pre-tokenizers read here: GPT-2's split, alone or after isolating every digit; any other is refused, not guessed.
GPT2_SPLIT_PRE = {"default", "gpt2", "mpt", "olmo", "jais"}
DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


class GgufError(ValueError):
    """The file cannot be served: not GGUF, another architecture, an unknown quantization; ``str()`` says which."""


@dataclass
class GgufModel:
    config: ModelConfig
    state: dict[str, torch.Tensor]  # float32, shared.llama.Llama's names, q/k/v and gate/up fused
    tokenizer: object  # shared.tokenizer.HFTokenizer


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rows (i, i + D/2) as (2i, 2i + 1) in each of ``heads`` heads of a q or k projection."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, max_context: int | None = None) -> ModelConfig:
    """The model's shape from the ``llama.*`` keys; ``max_context`` caps the served context."""
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise GgufError(f"architecture {architecture!r} is not read here: only 'llama' (Llama, SmolLM, Mistral) GGUF files")
    key = lambda name: _field(reader, f"llama.{name}")  # noqa: E731
    width, heads = int(key("embedding_length")), int(key("attention.head_count"))
    rope_dims = key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != width // heads:
        raise GgufError(f"rotary over {rope_dims} of {width // heads} dimensions per head is not supported")
    context = int(key("context_length"))
    if max_context is not None:
        if max_context > context:
            raise GgufError(f"a context of {max_context} tokens is longer than the model's {context}")
        context = max_context
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), n_ctx=context, n_embd=width,
        n_layer=int(key("block_count")), n_head=heads, family="llama",
        n_kv_head=int(key("attention.head_count_kv") or heads), intermediate_size=int(key("feed_forward_length")),
        rope_theta=float(key("rope.freq_base") or 10000.0), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
    )


def _dequantized(reader) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize
    arrays = {}
    for tensor in reader.tensors:
        try:
            arrays[tensor.name] = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise GgufError(f"tensor {tensor.name} is quantized as {tensor.tensor_type.name}, which gguf cannot dequantize") from None
    return arrays


def llama_state(arrays: dict[str, np.ndarray], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GGUF tensor names to :class:`shared.llama.Llama`'s, the rotary rows put back, q/k/v and gate/up fused."""
    tensor = lambda name: torch.from_numpy(np.require(arrays[name], np.float32, ["C", "W"]))  # noqa: E731  (memory-mapped F32: copied)
    state = {"embed_tokens.weight": tensor("token_embd.weight"), "norm.weight": tensor("output_norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = tensor("output.weight")
    for i in range(config.n_layer):
        block, ours = f"blk.{i}.", f"layers.{i}."
        arrays[block + "attn_q.weight"] = unpermute_rotary_rows(arrays[block + "attn_q.weight"], config.n_head)
        arrays[block + "attn_k.weight"] = unpermute_rotary_rows(arrays[block + "attn_k.weight"], config.kv_heads)
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat([tensor(block + f"attn_{p}.weight") for p in "qkv"])
        if config.qkv_bias:
            state[ours + "self_attn.qkv_proj.bias"] = torch.cat([tensor(block + f"attn_{p}.bias") for p in "qkv"])
        state[ours + "self_attn.o_proj.weight"] = tensor(block + "attn_output.weight")
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat([tensor(block + "ffn_gate.weight"), tensor(block + "ffn_up.weight")])
        state[ours + "mlp.down_proj.weight"] = tensor(block + "ffn_down.weight")
        state[ours + "input_layernorm.weight"] = tensor(block + "attn_norm.weight")
        state[ours + "post_attention_layernorm.weight"] = tensor(block + "ffn_norm.weight")
    return state


def gguf_tokenizer(reader):
    """The file's byte-level BPE (``tokenizer.ggml.model == 'gpt2'``) as a ``tokenizers`` tokenizer, control tokens special."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from shared.tokenizer import HFTokenizer
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(f"tokenizer model {kind!r} is not read here: only byte-level BPE ('gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges") or []]
    bpe = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre in DIGIT_SPLITTING_PRE:
        bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level])
    elif pre in GPT2_SPLIT_PRE:
        bpe.pre_tokenizer = byte_level
    else:
        raise GgufError(f"pre-tokenizer {pre!r} is not read here: {', '.join(sorted(GPT2_SPLIT_PRE | DIGIT_SPLITTING_PRE))}")
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind == CONTROL_TOKEN])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return HFTokenizer(bpe, vocab_size=len(tokens), eos_id=eos, bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
                       pad_id=_field(reader, "tokenizer.ggml.padding_token_id", eos),
                       chat_template=_field(reader, "tokenizer.chat_template"))


def read_gguf(path: Path, max_context: int | None = None) -> GgufModel:
    """Read, check and dequantize ``path``; raises :class:`GgufError` with the reason when it cannot be served."""
    from gguf import GGUFReader
    path = Path(path)
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise GgufError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    reader = GGUFReader(path)
    config = gguf_config(reader, max_context)
    return GgufModel(config=config, state=llama_state(_dequantized(reader), config), tokenizer=gguf_tokenizer(reader))
