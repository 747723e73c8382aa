"""Choosing the next token: greedy by default; temperature, top-k, top-p and a seed when asked; log-probabilities.

Every chapter so far decodes greedily: the next token is the logits' argmax, so every server's tokens
equal the oracle's. A user of an OpenAI-style server also asks for SAMPLING: draw the next token from
the model's distribution, reshaped by

- ``temperature`` T: the logits are divided by T before the softmax (T < 1 sharpens, T > 1 flattens;
  0 means greedy, the default, and stays token-exact);
- ``top_k`` k: only the k most likely tokens may be drawn (0: no limit);
- ``top_p`` p (nucleus sampling): only the smallest set of most likely tokens whose probabilities
  add up to at least p (1: no limit).

**Seeds and batching.** Each sequence draws from ITS OWN random generator (``torch.Generator``),
seeded from the request's ``seed`` (or at random without one), and draws exactly one number per
sampled token (inverse transform sampling: the first token whose cumulative probability passes it). Which other sequences share a step therefore never changes the numbers a sequence
draws: a seeded request gets the same tokens alone or batched. What batching can NOT promise is
bit-identical logits: a packed step sums in another order than a lone one, so a probability that
sits exactly on a draw's boundary may tip the other way. At fp32 that is rare, not impossible
(vLLM and every other batching server say the same of their seeds).

**Log-probabilities** (OpenAI's ``logprobs``) are those of the model's own distribution, the
softmax of its logits before temperature, top-k and top-p reshape it (vLLM reports the same by
default): the chosen token's, and the ``logprobs`` most likely alternatives'.

Written once and used by chapter 8's update step (:meth:`ContinuousScheduler.update
<chapters.ch08_continuous_batching.scheduler.ContinuousScheduler.update>`): a step whose rows are all
greedy without log-probabilities is one ``argmax`` over the batch, as before; the rows that sample
are filtered together, as one (R, V) tensor: a few tensor operations a step, not a few per row.
"""

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
        """The sequence's own random stream (None for greedy: it draws nothing)."""
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
    """``logits`` (R, V) with every token outside its row's ``top_k`` (R, 1) largest set to -inf.

    A ``top_k`` of 0 keeps the whole row; ties with the k-th largest are all kept.
    """
    k = top_k.clamp(max=logits.shape[-1])
    largest = torch.topk(logits, max(int(k.max()), 1), dim=-1).values  # only as many as the largest k: no full sort
    kth = torch.where(k > 0, largest.gather(-1, (k - 1).clamp(min=0)), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def keep_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """``logits`` (R, V) with every token outside its row's nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probabilities add up to at least the
    row's ``top_p`` (R, 1); the most likely token is always in it, and a ``top_p`` of 1 keeps the whole row.
    """
    # EXERCISE ch08.7 BEGIN "top-p (nucleus) sampling: keep the smallest most likely set that reaches p"
    probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each one
    drop = (before >= top_p) & (top_p < 1)  # the set already reached p without it (rounding must not cut a p of 1)
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    # EXERCISE ch08.7 END


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
    """One token per row of ``probs`` (R, V): the first whose cumulative probability passes a uniform draw
    from that row's generator (inverse transform sampling: one number per token)."""
    uniform = torch.cat([torch.rand(1, generator=generator) for generator in generators]).to(probs.device)
    cumulative = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)
    return picked.clamp(max=probs.shape[-1] - 1).squeeze(-1).tolist()


def sample_tokens(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
                  ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The next token of each row of ``logits`` (R, V), and its log-probabilities where asked.

    Row ``i`` follows ``params[i]``, drawing from ``generators[i]`` (None where greedy). The rows that
    sample are computed together; only the draws are one per row, each from its own generator.
    """
    tokens = logits.argmax(dim=-1).tolist()
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
