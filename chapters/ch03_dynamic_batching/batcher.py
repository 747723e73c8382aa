"""A dynamic batcher: requests wait in one queue and leave for the model together.

Rules: (1) a batch leaves ``window_s`` after its oldest request arrived, or (2) at once when ``min_batch`` wait; (3) at most
``max_batch`` per batch; (4) first in, first out; (5) the batch runs in one thread while the next fills; (6) a failing batch fails
exactly its own requests (500); (7) a request whose client left before its batch started gets 499; a cancelled one leaves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from chapters.ch02_fastapi_async.api import DisconnectCheck
from chapters.ch03_dynamic_batching.live_view import LiveEvents, server_time
from shared.schemas import ApiError

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")
ResultT = TypeVar("ResultT")

# Blocking: computes a whole batch; returns one result per request, in order.
BatchRunner = Callable[[list[RequestT]], list[ResultT]]


class Clock(Protocol):
    """The only two things the batcher needs from time; injectable so tests never sleep."""

    def now(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        """Return once ``event`` is set or ``timeout`` seconds have passed (``None``: no time limit)."""
        ...


class MonotonicClock:
    """Real time: ``time.monotonic`` and ``asyncio.wait_for``."""

    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass


class ClientDisconnected(ApiError):
    """The request was dropped before computing because its client went away (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__(499, "client_disconnected", "the client disconnected before its batch started")


@dataclass(eq=False)  # compared by identity: two equal requests are still two clients
class _Waiting(Generic[RequestT, ResultT]):
    request: RequestT
    future: asyncio.Future[ResultT]
    arrived: float
    is_disconnected: DisconnectCheck | None = None


@dataclass(frozen=True)
class BatcherConfig:
    max_batch: int = 32
    min_batch: int = 8
    window_s: float = 0.005

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(f"need 1 <= min_batch <= max_batch, got min_batch={self.min_batch}, max_batch={self.max_batch}")
        if self.window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {self.window_s}")


@dataclass
class BatcherStats:
    batches: int = 0
    requests: int = 0
    failed_batches: int = 0
    dropped_disconnected: int = 0
    largest_batch: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)  # batch size -> batches of that size


class DynamicBatcher(Generic[RequestT, ResultT]):
    """Collect requests into batches by the rules above; compute them in ``executor`` (default: its own thread).
    :meth:`start` in a running loop, :meth:`submit` from handlers, :meth:`close` to drain (new submits 503, queued computed)."""

    def __init__(
        self,
        run_batch: BatchRunner[RequestT, ResultT],
        config: BatcherConfig = BatcherConfig(),
        *,
        clock: Clock | None = None,
        executor: Executor | None = None,
        describe_row: Callable[[RequestT], tuple[int, int]] | None = None,
    ) -> None:
        self.config = config
        self._describe_row = describe_row  # (prompt length, new tokens) of a request, for the live page
        self._run_batch = run_batch
        self._clock = clock or MonotonicClock()
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self._queue: deque[_Waiting[RequestT, ResultT]] = deque()
        self._arrival = asyncio.Event()  # set on every arrival (and on close): wakes the collector
        self._device_free = asyncio.Event()  # cleared while a batch computes
        self._device_free.set()
        self._in_flight: asyncio.Task[None] | None = None  # the batch on the device (a reference keeps the task alive)
        self._collector: asyncio.Task[None] | None = None
        self._closing = False
        self.stats = BatcherStats()
        self.events = LiveEvents(hello=lambda: {"kind": "batcher", **self.describe()})

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not counting the batch on the device)."""
        return len(self._queue)

    def enqueue(self, request: RequestT, is_disconnected: DisconnectCheck | None = None) -> asyncio.Future[ResultT]:
        """Queue ``request`` and return its own future (synchronous: the order of calls is the order served)."""
        if self._closing:
            raise ApiError(503, "draining", "the server is shutting down and takes no new requests")
        if self._collector is not None and self._collector.done():
            raise ApiError(503, "batcher_stopped", "the batcher has stopped; see the server log")
        future: asyncio.Future[ResultT] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(request, future, self._clock.now(), is_disconnected))
        self._arrival.set()
        if self.events.watched:
            self._publish_queue()
        return future

    async def submit(self, request: RequestT, is_disconnected: DisconnectCheck | None = None) -> ResultT:
        """Queue ``request`` and wait for its result; raises what its batch raised (as :class:`ApiError`)."""
        future = self.enqueue(request, is_disconnected)
        try:
            return await future
        except asyncio.CancelledError:
            # The handler was cancelled: the request must neither count towards min_batch nor be computed.
            self._forget(future)
            raise

    def _forget(self, future: asyncio.Future[ResultT]) -> None:
        for waiting in self._queue:
            if waiting.future is future:
                self._queue.remove(waiting)
                if self.events.watched:
                    self._publish_queue()
                return

    def start(self) -> None:
        """Start collecting; call from inside the running event loop (e.g. a FastAPI lifespan)."""
        if self._collector is None:
            self._collector = asyncio.create_task(self._collect_forever(), name="batcher")

    async def close(self) -> None:
        """Take no new requests, compute every queued one, wait for the device, release the thread."""
        self._closing = True
        self._arrival.set()
        self.start()  # a batcher closed before it ever started still computes what was queued
        await self._collector
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    async def _collect_forever(self) -> None:
        try:
            while await self._wait_for_first_arrival():
                await self._wait_for_trigger()
                why = self._why_now()
                await self._wait_for_device()
                batch = await self._take_batch()
                if batch:
                    self._device_free.clear()
                    if self.events.watched:
                        self._publish_batch(batch, why)
                    self._in_flight = asyncio.create_task(self._compute(batch))
            await self._wait_for_device()
        except BaseException as exc:
            # A bug here must not leave clients hanging forever: fail whatever is still queued.
            for waiting in self._queue:
                if not waiting.future.done():
                    waiting.future.set_exception(ApiError(500, "batcher_failed", f"the batcher stopped: {exc!r}"))
            self._queue.clear()
            raise

    async def _wait_for_first_arrival(self) -> bool:
        """Block until something is queued; False once closing with nothing left to do."""
        while not self._queue:
            if self._closing:
                return False
            self._arrival.clear()
            await self._clock.wait(self._arrival, None)
        return True

    async def _wait_for_trigger(self) -> None:
        """Return when ``min_batch`` requests wait, the oldest has waited a full window, the queue is empty, or closing."""
        # EXERCISE ch03.1 BEGIN "the batcher's triggers: a window from the first arrival, and min_batch"
        while self._queue and len(self._queue) < self.config.min_batch and not self._closing:
            # Recomputed each turn: the deadline belongs to whoever is oldest now (the head may have been cancelled).
            remaining = self._queue[0].arrived + self.window_s() - self._clock.now()
            if remaining <= 0:
                return
            self._arrival.clear()
            await self._clock.wait(self._arrival, remaining)

    def window_s(self) -> float:
        """How long the batch being formed may wait for company: fixed here; chapter 6 adapts it."""
        return self.config.window_s

    def _why_now(self) -> str:
        """Why the next batch leaves, for the live page: read when the trigger fires."""
        if self._closing:
            return "draining"
        if not self._device_free.is_set():
            return "device_busy"  # ready while a batch computes: it grows until the device is free (rule 5)
        return "min_batch" if len(self._queue) >= self.config.min_batch else "window"

    async def _wait_for_device(self) -> None:
        """While the previous batch computes, the queue keeps filling; the next batch is taken after."""
        while not self._device_free.is_set():
            await self._clock.wait(self._device_free, None)

    async def _take_batch(self) -> list[_Waiting[RequestT, ResultT]]:
        """Pop up to ``max_batch`` of the oldest requests whose clients are still there. Skips a request whose future is done; one
        whose client is gone fails with :class:`ClientDisconnected` (``stats.dropped_disconnected``); neither counts."""
        # EXERCISE ch03.2 BEGIN "the FIFO cut: at most max_batch of the oldest, skipping clients that are gone"
        batch: list[_Waiting[RequestT, ResultT]] = []
        while self._queue and len(batch) < self.config.max_batch:
            waiting = self._queue.popleft()
            if waiting.future.done():
                continue  # cancelled while queued
            gone = await self._client_gone(waiting)
            if waiting.future.done():
                continue  # cancelled while its client was being checked (a deadline, say)
            if gone:
                self.stats.dropped_disconnected += 1
                waiting.future.set_exception(ClientDisconnected())
                continue
            batch.append(waiting)
        return batch

    @staticmethod
    async def _client_gone(waiting: _Waiting[RequestT, ResultT]) -> bool:
        if waiting.is_disconnected is None:
            return False
        try:
            return await waiting.is_disconnected()
        except Exception:  # a broken check must not stop the collector: assume the client is there
            log.exception("is_disconnected failed; computing the request anyway")
            return False

    async def _compute(self, batch: list[_Waiting[RequestT, ResultT]]) -> None:
        """Run one batch in the inference thread and hand each request its own result or error."""
        requests = [waiting.request for waiting in batch]
        loop = asyncio.get_running_loop()
        self._record(len(batch))
        started = self._clock.now()
        failed = False
        try:
            results = await loop.run_in_executor(self._executor, self._run_batch, requests)
            if len(results) != len(batch):
                raise RuntimeError(f"the batch runner returned {len(results)} results for {len(batch)} requests")
        except Exception as exc:  # never re-raised: nobody awaits this task, its requests hear of it
            self.stats.failed_batches += 1
            failed = True
            log.exception("a batch of %d requests failed", len(batch))
            message = f"the batch of {len(batch)} requests failed: {type(exc).__name__}: {exc}"
            for waiting in batch:
                if not waiting.future.done():  # its client may have been cancelled meanwhile
                    waiting.future.set_exception(ApiError(500, "batch_failed", message))
        else:
            for waiting, result in zip(batch, results):
                if not waiting.future.done():
                    waiting.future.set_result(result)
        finally:
            self._device_free.set()
            if self.events.watched:
                self._publish_done(batch, started, failed)

    def _record(self, size: int) -> None:
        self.stats.batches += 1
        self.stats.requests += size
        self.stats.largest_batch = max(self.stats.largest_batch, size)
        self.stats.batch_sizes[size] += 1

    def _publish_queue(self) -> None:
        now = self._clock.now()
        self.events.publish("queue", {
            "t": server_time(), "queued": len(self._queue), "window_ms": self.window_s() * 1e3,
            "oldest_waited_ms": (now - self._queue[0].arrived) * 1e3 if self._queue else 0.0,
        })

    def _publish_batch(self, batch: list[_Waiting[RequestT, ResultT]], why: str) -> None:
        now = self._clock.now()
        self.events.publish("batch", {
            "t": server_time(), "batch": self.stats.batches + 1, "size": len(batch), "why": why,
            "full": len(batch) == self.config.max_batch, "max_batch": self.config.max_batch,
            "window_ms": self.window_s() * 1e3, "waited_ms": (now - batch[0].arrived) * 1e3, "queued": len(self._queue),
            "oldest_waited_ms": (now - self._queue[0].arrived) * 1e3 if self._queue else 0.0,
            "rows": [self._describe_row(w.request) for w in batch] if self._describe_row else [],
        })

    def _publish_done(self, batch: list[_Waiting[RequestT, ResultT]], started: float, failed: bool) -> None:
        now = self._clock.now()
        self.events.publish("done", {
            "t": server_time(), "batch": self.stats.batches, "size": len(batch), "failed": failed,
            "compute_ms": (now - started) * 1e3, "latencies_ms": [(now - w.arrived) * 1e3 for w in batch],
            "batches": self.stats.batches, "requests": self.stats.requests, "failed_batches": self.stats.failed_batches,
            "largest_batch": self.stats.largest_batch, "queued": len(self._queue),
        })

    def describe(self) -> dict:
        """Configuration and counters, for ``/healthz``."""
        return {
            "max_batch": self.config.max_batch,
            "min_batch": self.config.min_batch,
            "window_ms": self.config.window_s * 1e3,
            "queued": self.queued,
            "batches": self.stats.batches,
            "requests": self.stats.requests,
            "mean_batch": round(self.stats.requests / self.stats.batches, 2) if self.stats.batches else 0.0,
            "largest_batch": self.stats.largest_batch,
            "failed_batches": self.stats.failed_batches,
            "dropped_disconnected": self.stats.dropped_disconnected,
            "batch_sizes": {str(size): count for size, count in sorted(self.stats.batch_sizes.items())},
        }
