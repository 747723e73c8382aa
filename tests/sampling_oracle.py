"""The sampling oracle: the plain model, one whole forward pass per token, each filter by its definition.

It shares no code with chapter 8's samplers; only the random draw is the same rule (one uniform
number from a generator seeded with the request's seed, and the first token whose cumulative
probability passes it), so a seeded request must give these tokens whatever batched it.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def model_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's logits (V,) for the token after ``ids``, fp32."""
    return model(torch.tensor([ids]), last_token_only=True)[0, -1].float()


def brute_force_nucleus(probs: list[float] | dict[int, float], top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches ``top_p``, by its definition.

    ``probs`` is every token's probability (a list) or the allowed tokens' (a dict, token to
    probability); only those can be chosen, so however the sum rounds (a ``top_p`` of 1 may never be
    reached in floating point) no other token comes back.
    """
    if not isinstance(probs, dict):
        probs = dict(enumerate(probs))
    kept, mass = set(), 0.0
    for token in sorted(probs, key=lambda t: -probs[t]):
        kept.add(token)
        mass += probs[token]
        if mass >= top_p:
            break
    return kept


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then the ``top_k`` most likely, then the nucleus of what is left; renormalised.

    Each filter is computed on the set the previous one allowed, never on the whole vocabulary.
    """
    scaled = logits.double() / temperature
    allowed = torch.argsort(scaled, descending=True)[:top_k] if top_k else torch.arange(scaled.numel())
    allowed_probs = torch.softmax(scaled[allowed], -1)
    nucleus = sorted(brute_force_nucleus(dict(zip(allowed.tolist(), allowed_probs.tolist())), top_p))
    distribution = torch.zeros_like(scaled)
    distribution[nucleus] = torch.softmax(scaled[nucleus], -1)
    return distribution.float()


def reference_sampled(model, prompt: list[int], n: int, seed: int, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> list[int]:
    """``n`` tokens sampled after ``prompt`` from a generator seeded with ``seed``."""
    ids, generator = list(prompt), torch.Generator().manual_seed(seed)
    for _ in range(n):
        probs = reference_distribution(model_logits(model, ids), temperature, top_k, top_p).tolist()
        target, total = float(torch.rand(1, generator=generator)) * sum(probs), 0.0
        token = next(i for i, p in enumerate(probs) if p > 0 and (total := total + p) > target)
        ids.append(token)
    return ids[len(prompt):]
