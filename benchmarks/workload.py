"""The workload every chapter is measured with: which prompts, how many new tokens, what a right answer is.

Kept apart from ``locustfile.py`` so that the harness (warm-up), the harness's ceiling server and
the tests can use the same definitions without importing Locust, which monkey-patches the
interpreter with gevent as soon as it is imported.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# Prompt lengths, drawn uniformly: the article's mix. Ids are bytes, valid in every model we serve
# (the byte-level tiny model has 258 ids, GPT-2 has 50257).
PROMPT_LENGTHS: tuple[int, ...] = (16, 32, 64, 128)
PROMPT_ID_RANGE = 256
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class Workload:
    """A named request mix: every request asks for exactly ``max_new_tokens`` new tokens."""

    name: str
    max_new_tokens: int
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS


WORKLOADS: dict[str, Workload] = {
    # The climb's workload: short answers, so a chapter's throughput is about serving, not decoding.
    "default": Workload("default", max_new_tokens=32),
    # Chapter 4's lesson: long generations make the KV cache, not the compute, the scarce resource.
    "long": Workload("long", max_new_tokens=256),
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
        length = self._rng.choice(self.workload.prompt_lengths)
        input_ids = [self._rng.randrange(PROMPT_ID_RANGE) for _ in range(length)]
        return {"input_ids": input_ids, "max_new_tokens": self.workload.max_new_tokens}


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
