"""The step thread: ONE thread turns chapter 3's step loop over the scheduler, fed from the event loop, never touching asyncio.

Between two steps it takes what :meth:`StepThread.submit` and :meth:`StepThread.cancel` queued; a step's output reaches the loop
in ONE ``loop.call_soon_threadsafe``. A failing step fails exactly the sequences it computed (500, ``batch_failed``)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from chapters.ch08_continuous_batching.continuous_metrics import StepClock, StepRecord
from chapters.ch08_continuous_batching.live_steps import StepView
from chapters.ch08_continuous_batching.model_runner import ModelRunner
from chapters.ch08_continuous_batching.request_stream import RequestStream, StreamListener, deliver
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, ContinuousStep, Sequence
from shared.schemas import ApiError

log = logging.getLogger(__name__)


class StepThread:
    """Owns the scheduler and the model runner; everything that changes them runs in its one thread."""

    def __init__(self, runner: ModelRunner, scheduler: ContinuousScheduler, stream_interval: int = 1) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.clock = StepClock()
        self._listener = StreamListener(stream_interval)
        scheduler.listener = self._listener
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: list[tuple[Sequence, ApiError]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failed_steps = 0
        self.view = StepView(scheduler)  # chapter 3's live page, drawing steps
        self.events = self.view.events
        self._last_step: tuple[ContinuousStep, StepRecord] | None = None  # the step the live page shows next

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
            self.view.after_step(*(self._last_step or (None, None)), self._listener.finished)
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

    def _flush(self) -> None:
        events = self._listener.take()
        if events and self._loop is not None:
            self._loop.call_soon_threadsafe(deliver, events)
