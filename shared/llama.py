"""The Llama family (Llama, SmolLM, Qwen2, Mistral; ``shared/LLAMA.md`` teaches it) behind :mod:`shared.model`'s interface."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shared.model import Attend, DecoderModel, ModelConfig


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 whatever the activations' dtype."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """The cosines and sines of every position up to ``n_ctx``, and the rotation they apply: pairs of dimensions
    (i, i + D/2) of a head are turned by ``position * theta ** (-2i / D)``:
    ``(first, second) -> (first * cos - second * sin, second * cos + first * sin)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, cpu = config.head_dim, torch.device("cpu")  # computed even where the weights are built on "meta"
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim))
        angles = torch.arange(config.n_ctx, dtype=torch.float32, device=cpu)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)  # (n_ctx, D): the same angle for i and i + D/2
        self.register_buffer("cos", angles.cos(), persistent=False)
        # The halves swapped ((second, first): a roll by D/2) times (-sin, sin) is the rotation's second term.
        sin = angles.sin()
        self.register_buffer("signed_sin", torch.cat([-sin[:, : dim // 2], sin[:, dim // 2 :]], dim=-1), persistent=False)

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        """``x`` (B, T, H, D) rotated for ``position_ids`` (B or 1, T)."""
        cos = self.cos[position_ids].to(x.dtype)[:, :, None]  # (B, T, 1, D)
        sin = self.signed_sin[position_ids].to(x.dtype)[:, :, None]
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.n_embd, config.n_embd + 2 * config.kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def heads(self, qkv: Tensor, rotate: RotaryEmbedding, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The fused projection's output (B, T, W + 2 W_kv) as q (B, H, T, D) and k, v (B, H_kv, T, D): views of ``qkv``,
        whose queries and keys are rotated for ``position_ids`` in place, together (one rotation over all their heads),
        so all three share one layout."""
        batch, length, _ = qkv.shape
        query_key = qkv[..., : (self.n_head + self.n_kv_head) * self.head_dim].view(batch, length, -1, self.head_dim)
        query_key.copy_(rotate(query_key, position_ids))
        q, k, v = qkv.view(batch, length, -1, self.head_dim).split([self.n_head, self.n_kv_head, self.n_kv_head], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.n_embd, 2 * config.mlp_width, bias=False)
        self.down_proj = nn.Linear(config.mlp_width, config.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self._rotary = [rotary]  # shared by every layer; a list keeps it out of this block's submodules

    def attention_inputs(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The half before attention: RMSNorm, the fused projection, then queries and keys rotated."""
        return self.self_attn.heads(self.self_attn.qkv_proj(self.input_layernorm(x)), self._rotary[0], position_ids)

    def after_attention(self, x: Tensor, y: Tensor) -> Tensor:
        """The half after it: attention's output ``y`` (B, H, T, D) projected and added to ``x``, then the MLP's residual."""
        x = x + self.self_attn.o_proj(y.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: Tensor, position_ids: Tensor, attend: Attend) -> Tensor:
        return self.after_attention(x, attend(self.self_attn.layer_index, *self.attention_inputs(x, position_ids)))


class Llama(DecoderModel):
    """Token embedding (no position table), Llama blocks, a final RMSNorm, a tied or separate output layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(config, i, self.rotary) for i in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    def head(self, x: Tensor) -> Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(self.norm(x), weight)

    @property
    def embedding(self) -> nn.Embedding:
        return self.embed_tokens
