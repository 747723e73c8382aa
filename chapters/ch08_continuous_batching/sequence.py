"""One request's state inside the engine, plain data: its tokens, how far its keys and values are computed, how it samples."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from chapters.ch08_continuous_batching.sampling import GREEDY, SamplingParams, TokenLogprobs


class StopCondition(Protocol):
    """Ends a sequence before its ``max_new_tokens`` (``stop_strings.StopStrings``: a stop string in its text)."""

    def reached(self, output_ids: list[int]) -> bool: ...


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    """``token_ids``: the prompt, then every token generated so far; ``num_computed``: the leading positions whose keys
    and values are cached (0 after a preemption). ``finish_reason``: "stop" when ``stop`` ended it, else "length"."""

    prompt_ids: list[int]
    max_new_tokens: int
    arrived: float = field(default_factory=time.perf_counter)
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    status: Status = Status.WAITING
    preemptions: int = 0
    scheduled_at: float | None = None  # first time any of it was computed
    first_token_at: float | None = None
    finished_at: float | None = None
    listener_data: object = None  # whatever the listener attaches (the engine: the request's stream)
    sampling: SamplingParams = GREEDY
    stop: StopCondition | None = None
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token when sampling.logprobs is set
    generator: torch.Generator | None = field(init=False, repr=False)  # its own random stream: batching never shifts it

    def __post_init__(self) -> None:
        if not self.prompt_ids or self.max_new_tokens < 1:
            raise ValueError("a sequence needs at least one prompt token and one new token")
        self.token_ids = list(self.prompt_ids)
        self.generator = self.sampling.generator()

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def peak_kv_tokens(self) -> int:
        """Positions it ever stores: the last generated token is returned, never fed back."""
        return len(self.prompt_ids) + self.max_new_tokens - 1
