"""Prometheus metrics: the article's four, plus latency by stage, errors by kind, batches, the KV pool, tokens, versions.

Per-request series (:class:`RequestMetrics`) are recorded when the response is sent; state (queue, memory, the pool,
batch sizes, versions) is read at scrape time by :class:`StateCollector`, through a state reader that turns any backend
into a :class:`BackendState` of plain numbers (:func:`pooled_state` for chapters 4-6).
"""

from __future__ import annotations

from collections import Counter as TallyCounter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shared.devices import memory_snapshot

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds, the article's
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Stages a request's timings_ms may hold (chapters 2-6) plus postprocess, measured here.
STAGES = ("admission", "queue", "prefill", "decode", "batch", "postprocess")


def error_kind(status: int, error_type: str) -> str:
    """The article's classes of error, each handled differently: timeout, out of memory, inference, rejected."""
    if status == 504:
        return "timeout"
    if "memory" in error_type or "oom" in error_type:
        return "out_of_memory"
    if status >= 500 and status != 503:
        return "inference"
    if status in (429, 503):
        return "rejected"
    if status == 499:
        return "disconnected"
    return "invalid_request"


class RequestMetrics:
    """The per-request series, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram("inference_request_latency_seconds", "whole-request latency (the article's buckets)",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("inference_request", "inference requests answered, by HTTP status", ["status"], registry=registry)
        self.errors = Counter("inference_errors", "failed inference requests by kind and contract error type",
                              ["kind", "type"], registry=registry)
        self.stage = Histogram("inference_stage_latency_seconds", "time spent in each stage of a successful request",
                               ["stage"], buckets=STAGE_BUCKETS, registry=registry)
        self.tokens = Counter("inference_tokens_generated", "new tokens returned to clients", registry=registry)
        self.prompt_tokens = Counter("inference_prompt_tokens", "prompt tokens of successful requests", registry=registry)

    def observe(self, status: int, seconds: float, error_type: str | None, stages_ms: dict[str, float],
                output_tokens: int, prompt_tokens: int) -> None:
        self.latency.observe(seconds)
        self.requests.labels(status=str(status)).inc()
        if status >= 400:
            self.errors.labels(kind=error_kind(status, error_type or ""), type=error_type or "unknown").inc()
        else:
            for stage, ms in stages_ms.items():
                if stage in STAGES:
                    self.stage.labels(stage=stage).observe(ms / 1e3)
            self.tokens.inc(output_tokens)
            self.prompt_tokens.inc(prompt_tokens)


@dataclass(frozen=True)
class BackendState:
    """What ``/metrics`` reads from one backend at scrape time: plain numbers, whatever the backend is."""

    waiting: int  # requests accepted and not computing yet
    kv_bytes_total: int  # the KV memory the backend holds
    kv_bytes_used: int  # ... of which taken by requests now
    batch_sizes: Mapping[int, int] = field(default_factory=dict)  # requests (rows) per batch or step -> how many so far
    kv_slot_bytes: Mapping[str, float] = field(default_factory=dict)  # counters: KV bytes "reserved", and "written" with a real token


def pooled_state(backend) -> BackendState:
    """Chapters 4-6's :class:`~chapters.ch04_memory_pool.pooled_backend.PooledBackend`: its batcher and its pool."""
    pool = backend.runner.stats()
    slot_bytes = pool["bytes_total"] / max(1, pool["blocks_total"] * pool["block_tokens"])
    return BackendState(
        waiting=backend.batcher.queued, kv_bytes_total=pool["bytes_total"], kv_bytes_used=pool["bytes_used"],
        batch_sizes=TallyCounter(backend.batcher.stats.batch_sizes),
        kv_slot_bytes={"reserved": pool["slots_reserved_total"] * slot_bytes, "written": pool["slots_written_total"] * slot_bytes},
    )


StateReader = Callable[[object], BackendState]


class StateCollector(Collector):
    """Reads the server's state when Prometheus scrapes: ``versions`` returns ``(name, source, state, in_flight)`` per
    loaded version; an unloaded version keeps its batch-size counts here (a counter never goes down)."""

    def __init__(self, versions: Callable[[], Iterable[tuple[str, str, BackendState, int]]], device: Callable[[], object],
                 ready: Callable[[], bool]) -> None:
        self.versions, self.device, self.ready = versions, device, ready
        self._batch_sizes: dict[str, TallyCounter[int]] = {}

    def collect(self):
        queue = GaugeMetricFamily("inference_queue_length", "requests accepted and waiting to be computed")
        in_flight = GaugeMetricFamily("inference_model_in_flight", "requests using each model version", labels=["version"])
        info = GaugeMetricFamily("inference_model_info", "loaded model versions (1 each)", labels=["version", "source"])
        pool_bytes = GaugeMetricFamily("inference_kv_pool_bytes", "KV pool bytes, allocated and taken by requests now",
                                       labels=["version", "state"])
        pool_slots = CounterMetricFamily("inference_kv_pool_slot_bytes", "KV bytes ever reserved by batches and those holding a real token",
                                         labels=["version", "kind"])
        waiting = 0
        for name, source, state, count in self.versions():
            waiting += state.waiting
            in_flight.add_metric([name], count)
            info.add_metric([name, source], 1)
            pool_bytes.add_metric([name, "total"], state.kv_bytes_total)
            pool_bytes.add_metric([name, "reserved"], state.kv_bytes_used)
            for kind, value in state.kv_slot_bytes.items():
                pool_slots.add_metric([name, kind], value)
            self._batch_sizes[name] = TallyCounter(state.batch_sizes)
        queue.add_metric([], waiting)
        yield from (queue, in_flight, info, pool_bytes, pool_slots)
        yield self._batch_histogram()
        memory = GaugeMetricFamily("inference_device_memory_bytes", "process RSS, and CUDA allocated/reserved on a GPU",
                                   labels=["kind"])
        for key, value in memory_snapshot(self.device()).items():
            memory.add_metric([key.removesuffix("_bytes")], value)
        yield memory
        ready = GaugeMetricFamily("inference_ready", "1 when /readyz would answer 200")
        ready.add_metric([], 1.0 if self.ready() else 0.0)
        yield ready

    def _batch_histogram(self) -> HistogramMetricFamily:
        sizes: TallyCounter[int] = TallyCounter()
        for tally in self._batch_sizes.values():
            sizes.update(tally)
        buckets, cumulative = [], 0
        for bound in BATCH_SIZE_BUCKETS:
            cumulative = sum(count for size, count in sizes.items() if size <= bound)
            buckets.append((str(bound), cumulative))
        buckets.append(("+Inf", sum(sizes.values())))
        family = HistogramMetricFamily("inference_batch_size", "requests per batch")
        family.add_metric([], buckets, sum_value=sum(size * count for size, count in sizes.items()))
        return family


def build_registry(state: StateCollector) -> tuple[CollectorRegistry, RequestMetrics]:
    """A registry of this server's own (not the process-global one: in-process tests build many apps)."""
    registry = CollectorRegistry()
    registry.register(state)
    return registry, RequestMetrics(registry)
