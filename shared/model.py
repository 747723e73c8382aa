"""The decoder every chapter serves: the step interface, the attend seam, and the GPT-2 family.

Two families sit behind one interface (:class:`DecoderModel`): the GPT-2 architecture here
(pre-LayerNorm blocks, learned positions, tanh-GELU MLP, tied embeddings) and the Llama
architecture in :mod:`shared.llama` (RMSNorm, rotary positions, a gated SiLU MLP, grouped-query
attention). No chapter asks which one it serves: :func:`build_model` builds either from its config.

The model never owns its KV cache. Each forward pass may be handed an object that follows the
:class:`KVCache` protocol (``seq_len``, ``update``, ``read``, ``advance``), so a chapter can swap the
cache (growing tensors, a pre-allocated pool, paged blocks) without touching this file.

Generation calls the model through two explicit steps, the same two every inference engine offers
(:class:`StepModel`): :meth:`DecoderModel.prefill` (the prompt, nothing cached yet) and :meth:`DecoderModel.decode`
(one more token per row, everything before it cached). Both return the last position's logits only.

Attention is the one place where a token meets the others, so it is the seam: each layer computes
its queries, keys and values and hands them to an :data:`Attend` function, which stores the new keys
and values wherever the cache keeps them and returns the attention output. The contiguous caches
(chapters 1-7) attend the dense way (:class:`DenseAttend`: the cache returns the whole history,
then SDPA). :meth:`DecoderModel.forward_packed` takes the attend function from the caller instead: one
flattened row of every token a step computes, for a paged cache that attends in place (chapter 8).

Left padding is supported for batched decoding: pass ``attention_mask`` (1 for real tokens, 0 for
padding, covering cached and new positions) and ``position_ids`` that count real tokens only.
Module names follow Hugging Face's GPT-2 (``h.0.attn.c_attn`` ...) so its checkpoints map one to one.
Keys and values have the model's key/value heads (``config.kv_heads``), which may be fewer than
its query heads: every cache is sized from them.
"""

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

    The Llama fields default to what makes a GPT: as many key/value heads as query heads, a 4x MLP.
    What a KV cache needs (:attr:`kv_heads`, :attr:`head_dim`, :meth:`kv_bytes_per_token`) is read
    from here, never from the query heads.
    """

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
    # SmolLM2-135M's shape (the Llama family): 9 query heads share 3 key/value heads.
    "smollm2-135m": ModelConfig(vocab_size=49152, n_ctx=8192, n_embd=576, n_layer=30, n_head=9, family="llama",
                                n_kv_head=3, intermediate_size=1536, rope_theta=100000.0),
    # A Llama small enough for the tests: byte vocabulary, 4 query heads over 2 key/value heads.
    "llama-tiny": ModelConfig(vocab_size=258, n_ctx=512, n_embd=256, n_layer=2, n_head=4, family="llama",
                              n_kv_head=2, intermediate_size=512),
}


class KVCache(Protocol):
    """The narrow interface between attention and whatever stores past keys and values.

    All rows of a batch share one ``seq_len`` (left padding keeps them aligned).
    """

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

    ``prefill`` and ``decode`` return float32 logits of each row's LAST position, shape (B, V).
    ``dtype`` is the dtype of the keys and values the model stores: a cache for it must use it.
    """

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
    """The simplest cache: per layer, concatenate new keys and values onto the old ones.

    Every decode step allocates a fresh, longer tensor per layer and copies the past into it. That
    is what chapter 4's memory pool removes.
    """

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
    """The contiguous caches' way to attend: the cache returns every stored key and value, SDPA reads them.

    ``mask`` is :func:`build_attention_mask`'s (None: plain causal, the fastest SDPA path).
    """

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

    # A layer is two halves around attention, so a compiler can take each half whole while attention,
    # which reads a cache it cannot see, stays the caller's call between them.
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

    ``attention_mask`` is (B, S) with S = past + T: 1 where a real token sits, 0 for padding.
    """
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
    # A padding query has no visible key: a fully masked row makes softmax NaN, and NaN in a
    # padded value would poison real rows (0 * NaN = NaN). Let every query see itself.
    return allowed | (key_pos[None, :] == query_pos[:, None])[None, None]


class DecoderModel(nn.Module):
    """What every family shares: the step interface over embed -> blocks -> head.

    A family supplies :meth:`embed` (token ids and positions to vectors), :attr:`blocks` (each with
    ``attention_inputs``, ``after_attention`` and ``forward(x, position_ids, attend)``) and
    :meth:`head` (final norm and output layer). Position ids always reach the blocks: a GPT adds its
    positions at the embedding, a Llama rotates queries and keys inside each block.
    """

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
        """Logits (B, T, V), or (B, 1, V) with ``last_token_only``.

        ``input_ids`` (B, T) are the new tokens; ``cache`` holds everything before them.
        ``position_ids`` default to ``past .. past+T-1`` (right for unpadded rows).
        """
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
        """One packed step: float32 logits (len(logits_indices), V) at the flattened positions ``logits_indices``.

        ``input_ids`` and ``position_ids`` are (N,): every token the step computes, sequence after
        sequence, no padding. Linear layers, norms and the MLP see exactly these N tokens; which
        token may attend to which, and where keys and values are stored, is ``attend``'s business
        (it receives (1, H, N, D) queries and (1, H_kv, N, D) keys and values). Only the rows in
        ``logits_indices`` reach the output layer.
        """
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
    """GPT-2's initialisation, seeded: the same seed gives the same bits on any machine.

    Norm weights 1, biases 0, every other weight normal with std 0.02 (the residual projections scaled
    down by the depth); a Llama gets the same rule.
    """
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
