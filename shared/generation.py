"""Greedy generation: the oracle every server is tested against, and the one-sequence generator; always ``max_new_tokens``."""

from __future__ import annotations

import torch

from shared.model import GPT, DynamicKVCache, KVCache


@torch.no_grad()
def reference_greedy(model: GPT, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: the ``max_new_tokens`` greedy continuation of ``prompt_ids``, computed the slow, obvious way."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    for _ in range(max_new_tokens):
        next_id = model(ids, last_token_only=True)[:, -1, :].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@torch.no_grad()
def greedy_generate(model: GPT, prompt_ids: list[int], max_new_tokens: int, cache: KVCache | None = None) -> list[int]:
    """One sequence with a KV cache: one forward pass over the prompt (prefill), then one token per step (decode)."""
    cache = cache if cache is not None else DynamicKVCache(model.config.n_layer)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        next_id = model(ids, cache=cache, last_token_only=True)[:, -1, :].argmax(dim=-1, keepdim=True)
        out.append(int(next_id))
        ids = next_id
    return out
