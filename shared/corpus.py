"""The default model's training corpus, generated from a seed: sentences from a small grammar, and two-digit additions with
the sum reversed (``37+45=28``, the ones digit first), a fixed tenth of whose operand pairs is held out for :func:`evaluate`."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.tokenizer import ByteTokenizer

OPERANDS = range(10, 100)
HELD_OUT_FRACTION = 0.1
SPLIT_SEED = 1234

_ADJECTIVES = "old young little quiet happy clever tired brave small red blue green golden".split()
_SUBJECTS = "robot cat farmer teacher child dog sailor baker pilot painter fox student".split()
_VERBS = "finds paints reads carries builds watches opens follows cleans draws".split()
_OBJECTS = "book kite boat letter map garden lamp bridge song window basket clock".split()
_PLACES = [
    "near the river", "in the garden", "at the station", "under the bridge", "by the sea",
    "in the kitchen", "on the hill", "after the rain", "before dinner", "in the morning",
]


def reversed_sum(a: int, b: int) -> str:
    return str(a + b)[::-1]


def addition_line(a: int, b: int) -> str:
    """One task line, newline included: ``37+45=28\\n``."""
    return f"{a}+{b}={reversed_sum(a, b)}\n"


def _split() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(SPLIT_SEED).shuffle(pairs)
    n_held = int(len(pairs) * HELD_OUT_FRACTION)
    return pairs[n_held:], pairs[:n_held]


TRAIN_PAIRS, HELD_OUT_PAIRS = _split()


def sentence(rng: random.Random) -> str:
    subject = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_SUBJECTS)}"
    obj = f"a {rng.choice(_ADJECTIVES)} {rng.choice(_OBJECTS)}"
    return f"{subject} {rng.choice(_VERBS)} {obj} {rng.choice(_PLACES)}.\n"


def corpus_lines(seed: int, arithmetic_share: float = 0.9) -> Iterator[str]:
    """An endless stream of lines: ``arithmetic_share`` of them additions from the training pairs."""
    rng = random.Random(seed)
    while True:
        if rng.random() < arithmetic_share:
            yield addition_line(*rng.choice(TRAIN_PAIRS))
        else:
            yield sentence(rng)


def training_batches(
    seed: int, batch_size: int, seq_len: int, arithmetic_share: float = 0.9
) -> Iterator[Tensor]:
    """Batches of shape (batch_size, seq_len + 1) byte ids, each row starting at a line start."""
    tokenizer = ByteTokenizer()
    lines = corpus_lines(seed, arithmetic_share)
    while True:
        rows = []
        for _ in range(batch_size):
            row: list[int] = []
            while len(row) < seq_len + 1:
                row.extend(tokenizer.encode(next(lines)))
            rows.append(row[: seq_len + 1])
        yield torch.tensor(rows, dtype=torch.long)


@dataclass(frozen=True)
class TaskScore:
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


LogitsFn = Callable[[Tensor], Tensor]  # (B, T) ids -> (B, T, V) logits


@torch.no_grad()
def evaluate(
    logits_fn: LogitsFn, pairs: list[tuple[int, int]] | None = None, batch_size: int = 256,
    device: torch.device | str = "cpu",
) -> TaskScore:
    """Exact-match accuracy on ``pairs`` (default: the held-out additions), greedy, prompt ``"ab+cd="``.
    ``logits_fn`` maps ids on ``device`` to logits (the model, or an engine at another precision)."""
    tokenizer = ByteTokenizer()
    pairs = HELD_OUT_PAIRS if pairs is None else pairs
    correct = 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        ids = torch.tensor([tokenizer.encode(f"{a}+{b}=") for a, b in chunk], dtype=torch.long, device=device)
        for _ in range(4):  # at most three digits, then the newline
            logits = logits_fn(ids)
            next_ids = logits[:, -1, :].float().argmax(dim=-1, keepdim=True).to(ids.device)
            ids = torch.cat([ids, next_ids], dim=1)
        for (a, b), row in zip(chunk, ids[:, 6:].tolist()):
            answer = tokenizer.decode(row).split("\n", 1)[0]
            correct += answer == reversed_sum(a, b)
    return TaskScore(correct=correct, total=len(pairs))
