"""Choosing the next token: greedy by default; temperature, top-k, top-p and a seed when asked; log-probabilities.

Each sequence draws one number per sampled token from its own generator, so a seeded request draws the same alone or batched
(a packed step sums in another order, so only a draw on a probability's very boundary may tip). Log-probabilities are the
model's own, before temperature, top-k and top-p reshape its distribution."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

MAX_LOGPROBS = 5  # OpenAI's completions API returns at most 5 alternatives
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0..2


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; the defaults are greedy decoding (every chapter's promise)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token may be drawn
    top_p: float = 1.0  # 1: every token may be drawn
    seed: int | None = None  # None: a random seed per request
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely ones' (0..5)

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        """The sequence's own random stream, seeded from ``seed`` or at random (None for greedy: it draws nothing)."""
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**63)
        return torch.Generator().manual_seed(seed)


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the ``n`` most likely tokens' (id, log-probability), most likely first."""

    logprob: float
    top: list[tuple[int, float]]


def keep_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """``logits`` (R, V), -inf outside each row's ``top_k`` (R, 1) largest; a ``top_k`` of 0 keeps all; ties with k-th stay."""
    k = top_k.clamp(max=logits.shape[-1])
    largest = torch.topk(logits, max(int(k.max()), 1), dim=-1).values  # only as many as the largest k: no full sort
    kth = torch.where(k > 0, largest.gather(-1, (k - 1).clamp(min=0)), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """``logits`` (R, V) with every token outside its row's nucleus set to -inf: the smallest set of most likely tokens whose
    probabilities reach its ``top_p`` (R, 1). The most likely token is always in it; a ``top_p`` of 1 keeps the whole row."""
    # EXERCISE ch08.7 BEGIN "top-p (nucleus) sampling: keep the smallest most likely set that reaches p"
    probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each one
    drop = (before >= top_p) & (top_p < 1)  # the set already reached p without it (rounding must not cut a p of 1)
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def sampling_distribution(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The probabilities (R, V) each row's token is drawn from: temperature, then top-k, then top-p."""
    column = partial(torch.tensor, device=logits.device)
    scaled = logits.float() / column([[p.temperature] for p in params])
    if any(p.top_k for p in params):  # each filter sorts or ranks the rows: only when a row asks for it
        scaled = keep_top_k(scaled, column([[p.top_k] for p in params]))
    if any(p.top_p < 1 for p in params):
        scaled = keep_top_p(scaled, column([[p.top_p] for p in params]))
    return torch.softmax(scaled, dim=-1)


def draw(probs: Tensor, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``probs`` (R, V): the first whose cumulative probability passes its generator's uniform draw."""
    uniform = torch.cat([torch.rand(1, generator=generator) for generator in generators]).to(probs.device)
    cumulative = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)
    return picked.clamp(max=probs.shape[-1] - 1).squeeze(-1).tolist()


def sample_tokens(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
                  ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Row ``i``'s next token by ``params[i]``, drawing from ``generators[i]`` (None: greedy), and its logprobs where asked."""
    tokens = logits.max(dim=-1).indices.tolist()  # argmax's first maximum too; the CPU's argmax is not vectorized
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    if all(p.greedy and p.logprobs is None for p in params):
        return tokens, logprobs  # the common case: one argmax for the whole step
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if sampled:
        probs = sampling_distribution(logits[sampled], [params[row] for row in sampled])
        for row, token in zip(sampled, draw(probs, [generators[row] for row in sampled]), strict=True):
            tokens[row] = token
    asked = [row for row, p in enumerate(params) if p.logprobs is not None]
    if asked:
        model_logprobs = torch.log_softmax(logits[asked].float(), dim=-1)
        chosen = model_logprobs.gather(-1, torch.tensor([[tokens[row]] for row in asked], device=logits.device))[:, 0].tolist()
        most = max(params[row].logprobs for row in asked)
        best = torch.topk(model_logprobs, most, dim=-1) if most else None
        for i, row in enumerate(asked):
            n = params[row].logprobs
            top = list(zip(best.indices[i, :n].tolist(), best.values[i, :n].tolist(), strict=True)) if best is not None else []
            logprobs[row] = TokenLogprobs(chosen[i], top)
    return tokens, logprobs
