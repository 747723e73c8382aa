"""The engine's side of a request's trace, from the step thread: its queue wait, prefill chunks and decode steps, under the
shell span of :mod:`.tracing`; built instead of the plain step thread with ``--otlp-endpoint``."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from chapters.ch08_continuous_batching.request_stream import Finished, RequestStream
from chapters.ch08_continuous_batching.scheduler import ContinuousStep, ScheduledRow, Sequence
from chapters.ch08_continuous_batching.step_thread import StepThread
from chapters.ch08_continuous_batching.tracing import RequestTrace, current_request_trace


@dataclass(eq=False)
class _SequenceTrace:
    """What the step thread learns about one traced sequence; its spans are made from it."""

    request: RequestTrace
    chunks: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # summed over its decode steps: how full the steps it rode in were
    decode_rows_max: int = 0
    decode_started: float | None = None
    decode_ended: float | None = None
    queue_closed: bool = False


class TracedStepThread(StepThread):
    """The step thread, also tracing sequences of a traced request: queue and chunk spans per step, decode once it ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._traced: dict[Sequence, _SequenceTrace] = {}  # added and removed on the loop, read by the step thread

    def submit(self, seq: Sequence) -> RequestStream:
        request = current_request_trace.get()
        if request is None:
            return super().submit(seq)
        request.span.add_event("admitted", {"prompt_tokens": len(seq.prompt_ids), "max_new_tokens": seq.max_new_tokens})
        self._traced[seq] = _SequenceTrace(request)  # before the step thread can see the sequence
        stream = super().submit(seq)
        stream.result.add_done_callback(functools.partial(self._ended, seq))
        return stream

    def step(self) -> None:
        started = time.perf_counter()
        super().step()
        # the step just computed, kept for the live page until the loop turns again
        if self._traced and self._last_step is not None:
            self._record(self._last_step[0], started, time.perf_counter())

    def _record(self, step: ContinuousStep, started: float, ended: float) -> None:
        traced = self._traced
        shared = {"step.tokens": step.num_tokens, "step.decode_rows": len(step.decode_rows)}
        for row in step.prefill_rows:
            if (seq_trace := traced.get(row.seq)) is not None:
                self._prefill_chunk(seq_trace, row, shared, started, ended)
        rows = len(step.decode_rows)
        for row in step.decode_rows:
            if (seq_trace := traced.get(row.seq)) is not None:
                seq_trace.decode_steps += 1
                seq_trace.decode_rows += rows
                seq_trace.decode_rows_max = max(seq_trace.decode_rows_max, rows)
                if seq_trace.decode_started is None:
                    seq_trace.decode_started = started
                seq_trace.decode_ended = ended

    def _prefill_chunk(self, seq_trace: _SequenceTrace, row: ScheduledRow, shared: dict, started: float, ended: float) -> None:
        seq = row.seq
        if not seq_trace.queue_closed:
            seq_trace.queue_closed = True
            seq_trace.request.child("queue", seq.arrived, seq.scheduled_at or started)
        seq_trace.request.child("prefill chunk", started, ended, {
            **shared, "prefill.chunk": seq_trace.chunks, "prefill.start_position": row.start, "prefill.tokens": row.length,
            "prefill.prompt_tokens": len(seq.prompt_ids),
            # read after the step's update, which gave the sequence the token this chunk's logits sampled
            "prefill.last_chunk": row.start + row.length == len(seq.token_ids) - 1,
            "sequence.preemptions": seq.preemptions,
        })
        seq_trace.chunks += 1

    def _ended(self, seq: Sequence, result) -> None:
        """On the loop, once the sequence has ended (finished, failed or aborted): its decode span."""
        seq_trace = self._traced.pop(seq, None)
        if seq_trace is None or result.cancelled():
            return
        finished: Finished = result.result()
        error = None if finished.error is None else f"{finished.error.status} {finished.error.type}"
        request, now = seq_trace.request, time.perf_counter()
        if not seq_trace.queue_closed:  # ended before any of it was computed (its client left, a deadline)
            request.child("queue", seq.arrived, now, error=error)
        if seq_trace.decode_steps:
            request.child("decode", seq_trace.decode_started, seq_trace.decode_ended, {
                "decode.steps": seq_trace.decode_steps, "decode.tokens": seq_trace.decode_steps,
                "decode.rows_mean": round(seq_trace.decode_rows / seq_trace.decode_steps, 2), "decode.rows_max": seq_trace.decode_rows_max,
                "output_tokens": len(finished.output_ids), "finish_reason": finished.finish_reason or "error",
            }, error=error)
        elif error is not None:
            request.span.add_event("ended", {"error": error})
