"""The workload every chapter is measured with: which prompts, how many new tokens, what a right answer is.

Kept apart from ``locustfile.py`` so that the harness (warm-up), the harness's ceiling server and
the tests can use the same definitions without importing Locust, which monkey-patches the
interpreter with gevent as soon as it is imported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# Prompt lengths, drawn uniformly: the article's mix. Ids are bytes, valid in every model we serve
# (the byte-level tiny model has 258 ids, GPT-2 has 50257).
PROMPT_LENGTHS: tuple[int, ...] = (16, 32, 64, 128)
PROMPT_ID_RANGE = 256
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class SharedPrefixes:
    """Prompts that repeat a prefix: ``count`` prefixes of ``length`` ids, each request one of them
    (uniformly) followed by its own suffix of a length drawn uniformly from ``suffix_lengths``.

    The prefixes come from ``prefix_seed`` alone, never from a run's or a user's seed: every user of
    every run, and every chapter compared, shares the same ones (as users of one service share its system
    prompt), so a cache of full prompt blocks can reuse them; a warm-up draws from the same prefixes, so
    a measured window starts with them cached (a running service's steady state). The suffixes come from
    the user's stream, so two requests share their prefix and nothing after it (a suffix of 8 random ids
    repeats with probability 256^-8).
    """

    count: int
    length: int
    suffix_lengths: tuple[int, ...]
    prefix_seed: int

    @cached_property
    def prefixes(self) -> tuple[tuple[int, ...], ...]:
        rng = random.Random(self.prefix_seed)
        return tuple(tuple(rng.randrange(PROMPT_ID_RANGE) for _ in range(self.length)) for _ in range(self.count))

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        return tuple(self.length + suffix for suffix in self.suffix_lengths)

    def prompt(self, rng: random.Random) -> list[int]:
        prefix = rng.choice(self.prefixes)
        suffix_length = rng.choice(self.suffix_lengths)
        return [*prefix, *(rng.randrange(PROMPT_ID_RANGE) for _ in range(suffix_length))]


@dataclass(frozen=True)
class Workload:
    """A named request mix: every request asks for exactly ``max_new_tokens`` new tokens.

    Prompts are ``prompt_lengths`` random ids (a length drawn uniformly), or, with ``shared_prefixes``,
    one of its prefixes and a short suffix (``prompt_lengths`` are then the lengths that mix gives).
    """

    name: str
    max_new_tokens: int
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS
    shared_prefixes: SharedPrefixes | None = None

    def body(self, rng: random.Random) -> dict[str, Any]:
        """One request, drawn from ``rng``: what every user of the Locust harness and of the streaming client sends."""
        if self.shared_prefixes is not None:
            return {"input_ids": self.shared_prefixes.prompt(rng), "max_new_tokens": self.max_new_tokens}
        length = rng.choice(self.prompt_lengths)
        input_ids = [rng.randrange(PROMPT_ID_RANGE) for _ in range(length)]
        return {"input_ids": input_ids, "max_new_tokens": self.max_new_tokens}


# 4 prefixes of 256 ids (16 of chapter 8's 16-token blocks each), suffixes of 8/16/24 ids, 32 new tokens:
# at most 312 positions, inside the smallest context served (the default model's 512).
SHARED_PREFIXES = SharedPrefixes(count=4, length=256, suffix_lengths=(8, 16, 24), prefix_seed=21)

WORKLOADS: dict[str, Workload] = {
    # The climb's workload: short answers, so a chapter's throughput is about serving, not decoding.
    "default": Workload("default", max_new_tokens=32),
    # Chapter 4's lesson: long generations make the KV cache, not the compute, the scarce resource.
    "long": Workload("long", max_new_tokens=256),
    # Chapter 8's prefix caching: traffic that repeats long prefixes (a system prompt, few-shot examples,
    # one document asked many questions). The mix: 4 prefixes of 256 ids shared by every request (each
    # request picks one uniformly), then a distinct suffix of 8, 16 or 24 ids, 32 new tokens.
    "shared-prefix": Workload("shared-prefix", max_new_tokens=32, prompt_lengths=SHARED_PREFIXES.prompt_lengths,
                              shared_prefixes=SHARED_PREFIXES),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


class PromptStream:
    """An endless, reproducible sequence of request bodies for one simulated user.

    Same ``seed`` and ``user_index``: same sequence of prompts, whatever the other users do.
    """

    def __init__(self, workload: Workload, seed: int, user_index: int) -> None:
        self.workload = workload
        self._rng = random.Random(seed * 1_000_003 + user_index)

    def next_body(self) -> dict[str, Any]:
        return self.workload.body(self._rng)


def check_response(status: int, body: Any, max_new_tokens: int, vocab_size: int) -> str | None:
    """``None`` when the answer honours the contract, else a short reason (used as the failure's message).

    A 200 is only a success when it carries exactly ``max_new_tokens`` ids, each inside the vocabulary:
    a server that answers fast with the wrong amount of work must not score.
    """
    if status != 200:
        return f"HTTP {status}"
    if not isinstance(body, dict) or not isinstance(body.get("output_ids"), list):
        return "200 without output_ids"
    output_ids = body["output_ids"]
    if len(output_ids) != max_new_tokens:
        return f"200 with {len(output_ids)} output ids, expected {max_new_tokens}"
    if not all(isinstance(token, int) and 0 <= token < vocab_size for token in output_ids):
        return f"200 with output ids outside [0, {vocab_size})"
    return None
