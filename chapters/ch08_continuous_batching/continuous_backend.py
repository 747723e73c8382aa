"""Chapter 2's ``Backend`` over the step thread, which also streams: admission (queue up to ``max_queue``, else 429), then a
:class:`~chapters.ch08_continuous_batching.scheduler.Sequence` for the step thread, aborted between two steps if the request is
cancelled. A request's accounting ends when its sequence ends, never when a reader stops reading."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass

from chapters.ch02_fastapi_async.api import DisconnectCheck, Generated
from chapters.ch03_dynamic_batching.batcher import ClientDisconnected
from chapters.ch04_memory_pool.admission import AdmissionConfig, AdmissionController
from chapters.ch07_production.metrics import BackendState
from chapters.ch08_continuous_batching.continuous_metrics import TokenLatencies
from chapters.ch08_continuous_batching.request_stream import Finished, RequestStream
from chapters.ch08_continuous_batching.sampled_contract import SampledRequest
from chapters.ch08_continuous_batching.sampling import GREEDY, TokenLogprobs
from chapters.ch08_continuous_batching.scheduler import Sequence
from chapters.ch08_continuous_batching.step_thread import StepThread
from shared.schemas import ValidRequest

# The id of the sequence the current request's task submitted last (the live page's row): read it after the backend call.
submitted_sequence: ContextVar[int | None] = ContextVar("submitted_sequence", default=None)


@dataclass
class Completion(Generated):
    """Chapter 2's :class:`Generated`, plus why the answer ended and, when asked, each token's log-probabilities."""

    finish_reason: str = "length"
    logprobs: list[TokenLogprobs] | None = None


class ContinuousBackend:
    """Admission, the step thread and each request's token stream (chapter 2's Backend, plus ``open_stream``)."""

    def __init__(self, step_thread: StepThread, max_queue: int, description: dict) -> None:
        self.step_thread = step_thread
        self.description = description
        manager = step_thread.scheduler.manager
        # Waiting, for admission: accepted beyond max_num_seqs, known at arrival without asking the step thread.
        max_num_seqs = step_thread.scheduler.config.max_num_seqs
        self.admission = AdmissionController(
            AdmissionConfig(max_waiting=max_queue, fallback_slots=0),
            waiting=lambda: max(0, self.in_flight - max_num_seqs),
            pool_use=lambda: 1.0 - manager.free_blocks / manager.total_blocks,
        )
        self.in_flight = 0
        self.cancelled = 0
        self.latencies = TokenLatencies()  # TTFT and TPOT of finished requests, for /metrics

    @property
    def waiting(self) -> int:
        """Requests accepted and not running yet (queued in the scheduler, or still in the step thread's inbox)."""
        return max(0, self.in_flight - len(self.step_thread.scheduler.running))

    async def start(self) -> None:
        self.step_thread.start(asyncio.get_running_loop())

    def _submit(self, request: ValidRequest) -> RequestStream:
        """Admit ``request`` (or raise 429) and hand it to the step thread."""
        self.admission.admit()
        arrived = time.perf_counter()
        sampling, stop = (request.sampling, request.stop) if isinstance(request, SampledRequest) else (GREEDY, None)
        seq = Sequence(list(request.input_ids), request.max_new_tokens, arrived=arrived, sampling=sampling, stop=stop)
        stream = self.step_thread.submit(seq)
        submitted_sequence.set(seq.seq_id)
        self.in_flight += 1

        def ended(result: asyncio.Future) -> None:
            self.in_flight -= 1
            self.admission.finished(time.perf_counter() - arrived)
            finished = result.result()
            if finished.error is None:
                self.latencies.observe(finished.timings_ms, len(finished.output_ids))

        stream.result.add_done_callback(ended)
        return stream

    def _cancel(self, stream: RequestStream) -> None:
        """Abort the sequence (its blocks are free after the current step); nothing if it already ended."""
        if not stream.result.done():
            self.cancelled += 1
            self.step_thread.cancel(stream.seq, ClientDisconnected())

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        # A client already gone is never computed; one that leaves later is noticed by the shell, which cancels this call.
        if await is_disconnected():
            raise ClientDisconnected()
        stream = self._submit(request)
        try:
            finished = await asyncio.shield(stream.result)
        except asyncio.CancelledError:
            self._cancel(stream)
            raise
        if finished.error is not None:
            raise finished.error
        return _completion(finished)

    async def open_stream(self, request: ValidRequest) -> AsyncIterator[int | Generated]:
        """Admit ``request`` now (429 before any response starts); yield its tokens, then a :class:`Generated`, or raise a
        later error (a failed step: 500). Closing the iterator early aborts the sequence."""
        return self._events(self._submit(request))

    async def _events(self, stream: RequestStream) -> AsyncIterator[int | Generated]:
        try:
            while not isinstance(event := await stream.next(), Finished):
                yield event
            if event.error is not None:
                raise event.error
            yield _completion(event)
        finally:
            self._cancel(stream)

    def health(self) -> dict:
        return dict(self.description)

    def stats(self) -> dict:
        return {
            **self.description,
            "in_flight": self.in_flight,
            "cancelled": self.cancelled,
            "admission": self.admission.stats(),
            "failed_steps": self.step_thread.failed_steps,
            "scheduler": self.step_thread.scheduler.describe(),
            "steps": self.step_thread.clock.describe(),
        }

    async def close(self) -> None:
        # The shell has drained: what was accepted is answered. Stop the thread after its last step.
        await asyncio.to_thread(self.step_thread.stop)


def _completion(finished: Finished) -> Completion:
    return Completion(finished.output_ids, finished.timings_ms, finished.finish_reason or "length", finished.logprobs)


def continuous_state(backend: ContinuousBackend) -> BackendState:
    """What chapter 7's ``/metrics`` reads: waiting sequences, KV blocks as bytes, decode rows per step."""
    scheduler = backend.step_thread.scheduler
    manager, store = scheduler.manager, scheduler.store
    block_bytes = store.pool.bytes_per_block
    rows = Counter(dict.copy(backend.step_thread.clock.decode_rows))  # dict.copy is one step under the GIL: the step thread adds to it
    return BackendState(
        waiting=backend.waiting,
        kv_bytes_total=manager.total_blocks * block_bytes,
        kv_bytes_used=(manager.total_blocks - manager.free_blocks) * block_bytes,
        batch_sizes=rows,
    )
