"""What chapter 3's live page shows of the step loop: ``step`` events from the step thread, only while someone watches, at most
``MAX_EVENTS_PER_S`` a second (the step before the loop goes idle always). Each event is a whole picture, so a page that
missed some is right again at the next; the cached-prefix blocks come every ``CACHED_EVERY_S``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from chapters.ch03_dynamic_batching.live_view import LiveEvents, server_time
from chapters.ch08_continuous_batching.continuous_metrics import StepClock, StepRecord
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, ContinuousStep, Sequence, Status

if TYPE_CHECKING:  # the step thread imports this module
    from chapters.ch08_continuous_batching.request_stream import Finished

WAITING_SHOWN = 32  # the page draws the head of the queue and counts the rest
MAX_EVENTS_PER_S = 30.0
CACHED_EVERY_S = 1.0  # the cached-prefix blocks (up to the whole pool) are sent this often, not every step


class StepView:
    """Builds the live page's events from one scheduler's state; call it in the step thread only."""

    def __init__(self, scheduler: ContinuousScheduler) -> None:
        self.scheduler = scheduler
        self.max_events_per_s = MAX_EVENTS_PER_S
        self._last_running: set[int] = set()  # as of the last event sent
        self._left: list[list] = []  # since the last event sent
        self._latencies: list[dict] = []
        self._sent_at = self._cached_sent_at = float("-inf")
        self.events = LiveEvents(hello=self.hello)  # what the page watches

    def after_step(self, step: ContinuousStep | None, record: StepRecord | None, finished: Mapping[Sequence, Finished]) -> None:
        """After each turn of the step thread's loop: publish the step's event while someone watches (``step`` None: idle)."""
        if not self.events.watched or (step is None and not finished):
            return
        timings = {phase: getattr(record, f"{phase}_ms") for phase in StepClock.PHASES} if record else None
        event = self.step_event(step, timings, finished, last=not self.scheduler.has_work)
        if event is not None:
            self.events.publish_threadsafe("step", event)

    def hello(self) -> dict:
        """The first event a page gets: the scheduler's settings and counters (read on the event loop)."""
        return {"kind": "steps", "stats": self.scheduler.describe()}

    def step_event(self, step: ContinuousStep | None, timings_ms: Mapping[str, float] | None,
                   finished: Mapping[Sequence, Finished], last: bool = False) -> dict | None:
        """The event after ``step`` (None: nothing ran), or None within ``1 / max_events_per_s`` of the last unless ``last``."""
        self._left += [[seq.seq_id, _why_left(seq, end)] for seq, end in finished.items()]
        self._latencies += [latency for end in finished.values() if (latency := _latency(end))]
        now = server_time()
        if not last and now - self._sent_at < 1.0 / self.max_events_per_s:
            return None
        self._sent_at = now
        scheduler, manager = self.scheduler, self.scheduler.manager
        running = {seq.seq_id for seq in scheduler.running}
        preempted = [seq.seq_id for seq in scheduler.waiting if seq.seq_id in self._last_running]
        cached = None  # None: as in the last event that had them
        if manager.prefix_caching and now - self._cached_sent_at >= CACHED_EVERY_S:
            cached, self._cached_sent_at = manager.identified_blocks(), now
        event = {
            "t": now,
            "stats": scheduler.describe(),
            "decode_rows": len(step.decode_rows) if step else 0,
            "prefill": [[row.seq.seq_id, row.start, row.length] for row in step.prefill_rows] if step else [],
            "timings_ms": dict(timings_ms or {}),
            "running": [[s.seq_id, len(s.prompt_ids), s.num_generated, s.max_new_tokens, s.num_computed, s.preemptions]
                        for s in scheduler.running],
            "waiting": [[s.seq_id, len(s.prompt_ids), s.num_generated, s.preemptions]
                        for s in list(scheduler.waiting)[:WAITING_SHOWN]],
            "joined": sorted(running - self._last_running),
            "left": self._left,
            "preempted": preempted,
            "latencies": self._latencies,
            "tables": {str(s.seq_id): list(manager.tables.get(s.seq_id, ())) for s in scheduler.running},
            "cached_blocks": cached,
        }
        self._last_running, self._left, self._latencies = running, [], []
        return event


def _why_left(seq: Sequence, end: Finished) -> str:
    """"stop" or "length" for an answer; the error's type (client_disconnected, batch_failed, ...) otherwise."""
    if end.error is not None:
        return end.error.type
    return seq.finish_reason or ("aborted" if seq.status is Status.ABORTED else "finished")


def _latency(end: Finished) -> dict | None:
    """TTFT and TPOT (ms) of a request that ended well, for the page's latency lines."""
    if end.error is not None or "ttft" not in end.timings_ms:
        return None
    n = len(end.output_ids)
    return {"ttft_ms": end.timings_ms["ttft"], "tpot_ms": end.timings_ms.get("decode", 0.0) / (n - 1) if n > 1 else None}
