"""The decoder every chapter serves: the step interface, the attend seam, and the GPT-2 family (Llama: :mod:`shared.llama`).

The model never owns its KV cache: a forward pass is handed a :class:`KVCache`, each layer hands q, k, v to an :data:`Attend`;
batches are left-padded, ``position_ids`` counting real tokens only. Module names follow Hugging Face's GPT-2."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape. ``family`` names its blocks: ``gpt2`` (this file) or ``llama`` (:mod:`shared.llama`).
    The Llama fields default to a GPT's (one key/value head per query head, a 4x MLP); caches are sized from :attr:`kv_heads`."""

    vocab_size: int
    n_ctx: int  # longest sequence (prompt + generated tokens) the positions cover
    n_embd: int
    n_layer: int
    n_head: int  # query heads
    layer_norm_eps: float = 1e-5  # the GPT's LayerNorm
    family: str = "gpt2"
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: one per query head
    intermediate_size: int | None = None  # the MLP's hidden width; None: 4 * n_embd
    rope_theta: float = 10000.0  # the Llama's rotary base
    rms_norm_eps: float = 1e-5  # the Llama's RMSNorm
    tie_word_embeddings: bool = True  # the output head reuses the token embedding
    qkv_bias: bool = False  # the Llama's q, k, v projections carry a bias (Qwen2 does)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.n_embd % self.n_head or self.n_head % self.kv_heads:
            raise ValueError(f"{self.n_head} query heads must divide the width {self.n_embd} and be a multiple "
                             f"of the {self.kv_heads} key/value heads")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def kv_width(self) -> int:
        """Key (or value) numbers one token stores per layer: key/value heads x head width."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of key and value cache one token occupies across all layers."""
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.n_layer * self.kv_width * element

    def to_dict(self) -> dict:
        return asdict(self)


FAMILIES = ("gpt2", "llama")

PRESETS: dict[str, ModelConfig] = {
    # ~3.3 M parameters: byte vocabulary, the embedded default model, the tests and the CPU benchmark.
    "tiny": ModelConfig(vocab_size=258, n_ctx=512, n_embd=256, n_layer=4, n_head=4),
    # The 124 M GPT-2 shape: the GPU benchmark, and real GPT-2 weights from a local directory.
    "gpt2": ModelConfig(vocab_size=50257, n_ctx=1024, n_embd=768, n_layer=12, n_head=12),
    # SmolLM2-135M's shape (the Llama family).
    "smollm2-135m": ModelConfig(vocab_size=49152, n_ctx=8192, n_embd=576, n_layer=30, n_head=9, family="llama",
                                n_kv_head=3, intermediate_size=1536, rope_theta=100000.0),
    # A Llama small enough for the tests: byte vocabulary, 4 query heads over 2 key/value heads.
    "llama-tiny": ModelConfig(vocab_size=258, n_ctx=512, n_embd=256, n_layer=2, n_head=4, family="llama",
                              n_kv_head=2, intermediate_size=512),
}


class KVCache(Protocol):
    """The narrow interface between attention and whatever stores past keys and values; all rows share one ``seq_len``."""

    @property
    def seq_len(self) -> int:
        """Positions already stored (before the current forward pass)."""
        ...

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``key``/``value`` of shape (B, H_kv, T, D) after position ``seq_len`` for ``layer``;
        return every stored key and value of that layer, shape (B, H_kv, seq_len + T, D)."""
        ...

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        """Every stored key and value of ``layer``, shape (B, H_kv, seq_len, D), without storing anything."""
        ...

    def advance(self, n_tokens: int) -> None:
        """Called once per forward pass, after all layers stored their ``n_tokens`` new positions."""
        ...


class StepModel(Protocol):
    """What generation drives: the model itself, or any inference engine built from it (chapter 5).
    ``prefill`` and ``decode`` return float32 logits (B, V) of each row's last position; a cache must use ``dtype``."""

    config: ModelConfig

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def prefill(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None,
                cache: KVCache | None) -> Tensor: ...
    def decode(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None,
               cache: KVCache) -> Tensor: ...


class DynamicKVCache:
    """The simplest cache: per layer, concatenate new keys and values onto the old ones (a new tensor every step)."""

    def __init__(self, n_layer: int) -> None:
        self._keys: list[Tensor | None] = [None] * n_layer
        self._values: list[Tensor | None] = [None] * n_layer
        self._seq_len = 0

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        past_k, past_v = self._keys[layer], self._values[layer]
        if past_k is not None:
            key = torch.cat([past_k, key], dim=2)
            value = torch.cat([past_v, value], dim=2)
        self._keys[layer], self._values[layer] = key, value
        return key, value

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        if self._keys[layer] is None:
            raise ValueError(f"layer {layer} has nothing cached yet")
        return self._keys[layer], self._values[layer]

    def advance(self, n_tokens: int) -> None:
        self._seq_len += n_tokens


Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]
"""``attend(layer, q, k, v) -> y``: this call's new positions, q (B, H, T, D) and k, v (B, H_kv, T, D)
(H_kv divides H: query head h reads key/value head h // (H / H_kv)); the function stores k and v
(if it caches) and returns the attention output for q, (B, H, T, D)."""


class DenseAttend:
    """Attend the contiguous caches' way: the cache returns every key and value, SDPA reads them (``mask``: None for causal)."""

    def __init__(self, cache: KVCache | None, mask: Tensor | None) -> None:
        self.cache, self.mask = cache, mask

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.cache is not None:
            k, v = self.cache.update(layer, k, v)
        grouped = q.shape[1] != k.shape[1]
        if self.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=grouped)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=grouped)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The fused projection's output (B, T, 3W) as q, k, v of (B, H, T, D) each: views, no copy."""
        batch, length, width3 = qkv.shape
        return tuple(t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in qkv.split(width3 // 3, dim=2))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_width)
        self.c_proj = nn.Linear(config.mlp_width, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = Attention(config, layer_index)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    # Two halves around attention: a compiler can take each whole while attention stays the caller's call between them.
    def qkv(self, x: Tensor) -> Tensor:
        """The half before attention: LayerNorm and the fused q, k, v projection, (B, T, W) -> (B, T, 3W)."""
        return self.attn.c_attn(self.ln_1(x))

    def attention_inputs(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of (B, H, T, D) for the tokens ``x``; a GPT's positions are already in ``x``."""
        return self.attn.heads(self.qkv(x))

    def after_attention(self, x: Tensor, y: Tensor) -> Tensor:
        """The half after it: attention's output ``y`` (B, H, T, D) projected and added to ``x``, then the MLP's residual."""
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln_2(x))

    def forward(self, x: Tensor, position_ids: Tensor, attend: Attend) -> Tensor:
        return self.after_attention(x, attend(self.attn.layer_index, *self.attention_inputs(x, position_ids)))


def build_attention_mask(attention_mask: Tensor | None, past: int, length: int) -> Tensor | None:
    """The boolean (B or 1, 1, T, S) mask SDPA needs, or None for the plain causal case.
    ``attention_mask`` is (B, S) with S = past + T: 1 where a real token sits, 0 for padding."""
    if attention_mask is None and (past == 0 or length == 1):
        return None  # causal alone; a single new token may see every cached position
    total = past + length
    device = attention_mask.device if attention_mask is not None else None
    key_pos = torch.arange(total, device=device)
    query_pos = torch.arange(past, total, device=device)
    allowed = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, T, S)
    if attention_mask is None:
        return allowed
    if attention_mask.shape[-1] != total:
        raise ValueError(f"attention_mask covers {attention_mask.shape[-1]} positions, expected {total}")
    allowed = allowed & attention_mask.bool()[:, None, None, :]
    # A fully masked (padding) row would make softmax NaN, which poisons real rows: every query sees itself.
    return allowed | (key_pos[None, :] == query_pos[:, None])[None, None]


class DecoderModel(nn.Module):
    """The step interface over a family's :meth:`embed` (ids, positions -> vectors), :attr:`blocks` (``attention_inputs``,
    ``after_attention``, ``forward(x, position_ids, attend)``) and :meth:`head` (final norm and output layer)."""

    config: ModelConfig

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def head(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def embedding(self) -> nn.Embedding:
        """The token embedding (the output layer's weight too where they are tied)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        last_token_only: bool = False,
    ) -> Tensor:
        """Logits (B, T, V), or (B, 1, V) with ``last_token_only``, of the new tokens ``input_ids`` (B, T) after ``cache``'s.
        ``position_ids`` default to ``past .. past+T-1``; ValueError past the context."""
        batch, length = input_ids.shape
        past = cache.seq_len if cache is not None else 0
        if past + length > self.config.n_ctx:
            raise ValueError(f"sequence of {past + length} tokens exceeds the context of {self.config.n_ctx}")
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=input_ids.device)[None, :]
        x = self.embed(input_ids, position_ids)
        attend = DenseAttend(cache, build_attention_mask(attention_mask, past, length))
        for block in self.blocks:
            x = block(x, position_ids, attend)
        if cache is not None:
            cache.advance(length)
        if last_token_only:
            x = x[:, -1:, :]
        return self.head(x)

    @torch.no_grad()
    def forward_packed(self, input_ids: Tensor, position_ids: Tensor, attend: Attend, logits_indices: Tensor) -> Tensor:
        """Float32 logits (len(logits_indices), V) of a packed step: ``input_ids``, ``position_ids`` (N,) are all its tokens, no
        padding; ``attend`` gets (1, H, N, D) queries and (1, H_kv, N, D) keys and values, and decides what sees what."""
        positions = position_ids[None]
        x = self.embed(input_ids[None], positions)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.head(x[0].index_select(0, logits_indices)).float()

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None,
                cache: KVCache | None) -> Tensor:
        """Logits (B, V) after the prompt ``input_ids``; its keys and values go into ``cache`` (if any)."""
        if cache is not None and cache.seq_len != 0:
            raise ValueError(f"prefill needs an empty cache; this one holds {cache.seq_len} positions")
        return self._last_logits(input_ids, position_ids, attention_mask, cache)

    @torch.no_grad()
    def decode(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None,
               cache: KVCache) -> Tensor:
        """Logits (B, V) after the new tokens ``input_ids`` (usually one per row); ``cache`` holds the rest."""
        if cache.seq_len == 0:
            raise ValueError("decode needs a cache that holds the prompt: call prefill first")
        return self._last_logits(input_ids, position_ids, attention_mask, cache)

    def _last_logits(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None,
                     cache: KVCache | None) -> Tensor:
        logits = self(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, last_token_only=True)
        return logits[:, -1, :].float()

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class GPT(DecoderModel):
    """GPT-2: learned positions added to the token embedding, LayerNorm, a GELU MLP, tied output layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_ctx, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return self.wte(input_ids) + self.wpe(position_ids)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.h

    def head(self, x: Tensor) -> Tensor:
        return F.linear(self.ln_f(x), self.wte.weight)  # tied input and output embeddings

    @property
    def embedding(self) -> nn.Embedding:
        return self.wte


def init_weights(model: DecoderModel, seed: int = 0) -> DecoderModel:
    """GPT-2's initialisation, seeded (same seed, same bits on any machine): norm weights 1, biases 0, other weights
    normal with std 0.02, the residual projections' scaled down by the depth."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # LayerNorm / RMSNorm weights
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("c_proj.weight", "o_proj.weight", "down_proj.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def build_model(config: ModelConfig) -> DecoderModel:
    """An uninitialised model of ``config``'s family."""
    if config.family == "llama":
        from shared.llama import Llama
        return Llama(config)
    return GPT(config)
