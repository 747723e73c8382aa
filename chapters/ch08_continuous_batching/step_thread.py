"""The step thread: chapter 3's step loop turned by ONE dedicated thread, fed from the event loop.

The event loop never computes and the step thread never touches asyncio objects directly:

- the loop hands work over with :meth:`StepThread.submit` and :meth:`StepThread.cancel`, which put
  it in an inbox under a lock and wake the thread (a condition variable: an idle step thread sleeps, it
  does not poll);
- between two steps the thread moves the inbox into the scheduler, aborts what was cancelled (a
  client gone, a deadline passed: chapter 7's shell decides; the blocks are free before the next
  step is planned), and turns chapter 3's
  loop once (schedule, execute, update), timing each phase (:class:`StepClock`: the scheduler's own
  cost must stay small and visible);
- what a step produced (new tokens, finished sequences) is handed back to the loop in ONE
  ``loop.call_soon_threadsafe`` per step, where each request's :class:`RequestStream` receives it;
  with ``stream_interval`` N above 1, a sequence's tokens are handed over in runs of N after its
  first (:class:`_StepListener`), so the loop wakes its request once per N tokens, not per token.

While someone watches chapter 3's live page (``/ui/``), the thread also publishes one ``step`` event
per step, at most ``MAX_EVENTS_PER_S`` a second
(:mod:`~chapters.ch08_continuous_batching.live_steps`); nobody watching costs one check.

A failing step fails exactly the sequences it computed (500, ``batch_failed``), frees their blocks,
and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass

from chapters.ch03_dynamic_batching.live_view import LiveEvents
from chapters.ch08_continuous_batching.live_steps import StepView
from chapters.ch08_continuous_batching.model_runner import ModelRunner
from chapters.ch08_continuous_batching.sampling import TokenLogprobs
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, ContinuousStep, Sequence
from shared.schemas import ApiError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """The end of a stream: the whole output, its timings and why it ended, or the error that ended it."""

    output_ids: list[int]
    timings_ms: dict[str, float]
    error: ApiError | None = None
    finish_reason: str | None = None  # "stop" (a stop string) or "length"; None when an error ended it
    logprobs: list[TokenLogprobs] | None = None  # one per output token, when the request asked


class SampledToken(int):
    """A token id that also carries its log-probabilities (a request that asked for them).

    It is an ``int``, so every reader of a token stream (chapter 2's protocol, chapter 7's shell)
    takes it as the id it is; chapter 8's OpenAI route reads :attr:`logprobs` from it.
    """

    logprobs: TokenLogprobs

    def __new__(cls, token: int, logprobs: TokenLogprobs) -> SampledToken:
        made = super().__new__(cls, token)
        made.logprobs = logprobs
        return made


class RequestStream:
    """The event-loop side of one sequence: its tokens as they come, then one :class:`Finished`.

    What a step hands over waits in a deque; a reader with nothing to read waits on one future, which
    the next hand-over resolves. Not an ``asyncio.Queue``: a queue wakes its getter and keeps its own
    books for every item put, and this stream gets one item per token, on the event loop every
    request shares. vLLM's ``RequestOutputCollector`` keeps no queue either (one slot that later
    outputs merge into, and an ``asyncio.Event``); here each token stays an item of its own.
    """

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


class _StepListener:
    """Collects tokens and endings in the step thread; what is due is flushed to the loop once per step.

    A sequence's tokens are due every ``stream_interval`` tokens: its first token at once (what the
    client waits for first), then each time ``stream_interval`` more have come, and whatever is left
    when it ends. At 1 every token is due in the step that made it.
    """

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
        self.finished[seq] = Finished(seq.output_ids, seq.timings_ms(), finish_reason=seq.finish_reason,
                                      logprobs=list(seq.logprobs) if seq.sampling.logprobs is not None else None)

    def end(self, seq: Sequence, error: ApiError) -> None:
        self.finished[seq] = Finished(seq.output_ids, seq.timings_ms(), error)

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


@dataclass(frozen=True)
class StepRecord:
    """One step: what it computed and where its time went (milliseconds)."""

    tokens: int  # tokens computed: decode rows + prompt-chunk tokens
    decode_rows: int
    prefill_tokens: int
    running: int  # sequences running after the step
    schedule_ms: float
    prepare_ms: float  # the runner's input preparation (packing, slot mapping, attention metadata)
    model_ms: float
    update_ms: float


class StepClock:
    """Per-phase time of every step: running totals, and the last ``keep`` steps for /stats and the notebook."""

    PHASES = ("schedule", "prepare", "model", "update")

    def __init__(self, keep: int = 256) -> None:
        self.totals_s = dict.fromkeys(self.PHASES, 0.0)
        self.recent: deque[StepRecord] = deque(maxlen=keep)
        self.decode_rows: Counter[int] = Counter()  # every step so far: decode rows -> steps

    def record(self, record: StepRecord) -> None:
        for phase in self.PHASES:
            self.totals_s[phase] += getattr(record, f"{phase}_ms") / 1e3
        self.recent.append(record)
        self.decode_rows[record.decode_rows] += 1

    def describe(self) -> dict:
        total = sum(self.totals_s.values())
        return {
            "seconds": {phase: round(value, 4) for phase, value in self.totals_s.items()},
            "share": {phase: round(value / total, 4) if total else None for phase, value in self.totals_s.items()},
            # copy() is one C call, so a step recorded by the step thread meanwhile cannot interrupt it;
            # iterating the deque itself while it grows raises "deque mutated during iteration".
            "recent": [asdict(r) for r in self.recent.copy()],
        }


class StepThread:
    """Owns the scheduler and the model runner; everything that changes them runs in its one thread."""

    def __init__(self, runner: ModelRunner, scheduler: ContinuousScheduler, stream_interval: int = 1) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.clock = StepClock()
        self._listener = _StepListener(stream_interval)
        scheduler.listener = self._listener
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: list[tuple[Sequence, ApiError]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed_steps = 0
        self.view = StepView(scheduler)
        self.events = LiveEvents(hello=self.view.hello)
        self._last_step: tuple[ContinuousStep, StepRecord] | None = None  # the step the next event shows

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="step-thread", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> RequestStream:
        """From the event loop: queue ``seq``; its tokens arrive on the returned stream."""
        stream = RequestStream(seq)
        seq.listener_data = stream
        with self._wake:
            self._inbox.append(seq)
            self._wake.notify()
        return stream

    def cancel(self, seq: Sequence, error: ApiError) -> None:
        """From the event loop: stop computing ``seq`` (its blocks are free after the current step)."""
        with self._wake:
            self._cancels.append((seq, error))
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._wake:
                while not (self._inbox or self._cancels or scheduler.has_work or self._stopping):
                    self._wake.wait()
                if self._stopping and not (self._inbox or scheduler.has_work):
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for seq in inbox:
                try:
                    scheduler.add(seq)
                except ValueError as exc:  # the API checked the limits; a direct caller may not have
                    self._listener.end(seq, ApiError(422, "invalid_request", str(exc)))
            for seq, error in cancels:
                if scheduler.abort(seq):
                    self._listener.end(seq, error)
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - one failed step must not stop the server
                log.exception("a step failed; failing the sequences it computed")
                self.failed_steps += 1
                self._fail_running(exc)
            if self.events.watched:
                self._publish()
            self._last_step = None
            self._flush()

    def step(self) -> None:
        """Chapter 3's :func:`~chapters.ch03_dynamic_batching.step_loop.run_step`, each phase timed."""
        started = time.perf_counter()
        step = self.scheduler.schedule()
        if step is None:
            return
        scheduled = time.perf_counter()
        logits = step.execute(self.runner)
        executed = time.perf_counter()
        self.scheduler.update(step, logits)
        done = time.perf_counter()
        record = StepRecord(
            tokens=step.num_tokens, decode_rows=len(step.decode_rows), prefill_tokens=step.num_tokens - len(step.decode_rows),
            running=len(self.scheduler.running), schedule_ms=(scheduled - started) * 1e3,
            prepare_ms=self.runner.last_prepare_s * 1e3, model_ms=self.runner.last_model_s * 1e3,
            update_ms=(done - executed) * 1e3,
        )
        self.clock.record(record)
        self._last_step = (step, record)

    def _fail_running(self, exc: Exception) -> None:
        for seq in list(self.scheduler.running):
            self.scheduler.abort(seq)
            self._listener.end(seq, ApiError(500, "batch_failed", f"the step computing this request failed: {type(exc).__name__}"))

    def _publish(self) -> None:
        """The live page's event for the step just taken (or for the endings alone, when nothing ran)."""
        finished = self._listener.finished
        if self._last_step is None and not finished:
            return
        step, record = self._last_step or (None, None)
        timings = {phase: getattr(record, f"{phase}_ms") for phase in StepClock.PHASES} if record else None
        event = self.view.step_event(step, timings, finished, last=not self.scheduler.has_work)
        if event is not None:
            self.events.publish_threadsafe("step", event)

    def _flush(self) -> None:
        events = self._listener.take()
        if events and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, events)


def _deliver(events: list[tuple[Sequence, list[int], Finished | None]]) -> None:
    for seq, tokens, finished in events:
        stream = seq.listener_data
        if isinstance(stream, RequestStream):
            stream.push(tokens, finished)
