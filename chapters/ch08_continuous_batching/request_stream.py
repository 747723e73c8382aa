"""The engine's output side: a :class:`StreamListener` hears each token and ending in the step thread; once per step what is due
goes to the event loop in one ``call_soon_threadsafe`` (:func:`deliver`), to each request's :class:`RequestStream`."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from chapters.ch08_continuous_batching.sampling import TokenLogprobs
from chapters.ch08_continuous_batching.scheduler import Sequence
from shared.schemas import ApiError


def timings_ms(seq: Sequence) -> dict[str, float]:
    """queue (arrival to first computed), prefill (to first token), ttft, decode (first to last token)."""
    out: dict[str, float] = {}
    if seq.scheduled_at is not None:
        out["queue"] = (seq.scheduled_at - seq.arrived) * 1e3
    if seq.first_token_at is not None and seq.scheduled_at is not None:
        out["prefill"] = (seq.first_token_at - seq.scheduled_at) * 1e3
        out["ttft"] = (seq.first_token_at - seq.arrived) * 1e3
    if seq.finished_at is not None and seq.first_token_at is not None:
        out["decode"] = (seq.finished_at - seq.first_token_at) * 1e3
    return out


@dataclass(frozen=True)
class Finished:
    """The end of a stream: the whole output, its timings and why it ended, or the error that ended it."""

    output_ids: list[int]
    timings_ms: dict[str, float]
    error: ApiError | None = None
    finish_reason: str | None = None  # "stop" (a stop string) or "length"; None when an error ended it
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked


class SampledToken(int):
    """A token id (an ``int`` to every reader of a token stream) that also carries its log-probabilities, when asked."""

    logprobs: TokenLogprobs

    def __new__(cls, token: int, logprobs: TokenLogprobs) -> SampledToken:
        made = super().__new__(cls, token)
        made.logprobs = logprobs
        return made


class RequestStream:
    """The event-loop side of one sequence: its tokens, then a :class:`Finished` (a deque and a future: cheaper than a Queue)."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self._pending: deque[int | Finished] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader's, while it waits
        self.result: asyncio.Future[Finished] = asyncio.get_running_loop().create_future()

    def push(self, tokens: list[int], finished: Finished | None) -> None:
        self._pending.extend(tokens)
        if finished is not None and not self.result.done():
            self._pending.append(finished)
            self.result.set_result(finished)
        if self._waiter is not None and not self._waiter.done():  # done: its reader was cancelled
            self._waiter.set_result(None)

    async def next(self) -> int | Finished:
        """The next event: a token as it is generated, or the :class:`Finished` event (the last)."""
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._pending.popleft()


class StreamListener:
    """Tokens and endings collected in the step thread; due: a sequence's first token, each ``stream_interval`` after, its end."""

    def __init__(self, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.tokens: dict[Sequence, list[int]] = {}  # made and not yet handed over
        self.finished: dict[Sequence, Finished] = {}
        self._started: set[Sequence] = set()  # sequences whose first token was handed over

    def on_token(self, seq: Sequence, token: int) -> None:
        if seq.sampling.logprobs is not None:
            token = SampledToken(token, seq.logprobs[-1])
        self.tokens.setdefault(seq, []).append(token)

    def on_finished(self, seq: Sequence) -> None:
        self.finished[seq] = Finished(seq.output_ids, timings_ms(seq), finish_reason=seq.finish_reason,
                                      logprobs=list(seq.logprobs) if seq.sampling.logprobs is not None else None)

    def end(self, seq: Sequence, error: ApiError) -> None:
        self.finished[seq] = Finished(seq.output_ids, timings_ms(seq), error)

    def take(self) -> list[tuple[Sequence, list[int], Finished | None]]:
        """What is due now: (sequence, its tokens held so far, its ending or None), each handed over once."""
        out = []
        for seq in [s for s, held in self.tokens.items()
                    if s in self.finished or s not in self._started or len(held) >= self.stream_interval]:
            out.append((seq, self.tokens.pop(seq), self.finished.pop(seq, None)))
            self._started.add(seq)
        for seq, finished in self.finished.items():  # ended with nothing held
            out.append((seq, [], finished))
        for seq, _, finished in out:
            if finished is not None:
                self._started.discard(seq)
        self.finished = {}
        return out


def deliver(events: list[tuple[Sequence, list[int], Finished | None]]) -> None:
    for seq, tokens, finished in events:
        stream = seq.listener_data
        if isinstance(stream, RequestStream):
            stream.push(tokens, finished)
