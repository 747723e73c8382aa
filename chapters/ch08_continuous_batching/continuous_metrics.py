"""What a continuous batcher adds to chapter 7's ``/metrics``, read at scrape time: TTFT and TPOT (per output token after the
first), sequences running and waiting, KV blocks, preemptions, tokens per step, the prefix cache's lookups and hits."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds per token


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
            # copy() is one C call the step thread cannot interrupt; iterating the growing deque itself may raise
            "recent": [asdict(r) for r in self.recent.copy()],
        }


class LatencyTally:
    """A histogram's bucket counts and sum, filled on the event loop, read by the collector."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds


def histogram_family(name: str, documentation: str, labels: list[str],
                     tallies: Iterable[tuple[list[str], LatencyTally]]) -> HistogramMetricFamily:
    """One Prometheus histogram, a series per label values, from tallies' counts (made cumulative here)."""
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for values, tally in tallies:
        cumulative, buckets = 0, []
        for bound, count in zip((*tally.bounds, float("inf")), tally.counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        family.add_metric(values, buckets, sum_value=tally.total)
    return family


class TokenLatencies:
    """TTFT and TPOT of the requests a backend finished, for ``/metrics``."""

    def __init__(self) -> None:
        self.ttft = LatencyTally(TTFT_BUCKETS)
        self.tpot = LatencyTally(TPOT_BUCKETS)

    def observe(self, timings_ms: dict[str, float], output_tokens: int) -> None:
        if "ttft" in timings_ms:
            self.ttft.observe(timings_ms["ttft"] / 1e3)
        if output_tokens > 1 and "decode" in timings_ms:
            self.tpot.observe(timings_ms["decode"] / 1e3 / (output_tokens - 1))


class ContinuousCollector(Collector):
    """Reads each loaded version's continuous backend at scrape time; ``versions`` yields ``(name, backend)``."""

    def __init__(self, versions: Callable[[], Iterable[tuple[str, object]]]) -> None:
        self.versions = versions

    def collect(self):
        loaded = list(self.versions())
        sequences = GaugeMetricFamily("inference_sequences", "sequences running in the step loop, and waiting for a place",
                                      labels=["version", "state"])
        blocks = GaugeMetricFamily("inference_kv_blocks", "KV blocks of the paged pool, used and free", labels=["version", "state"])
        preemptions = CounterMetricFamily("inference_preemptions", "sequences preempted (blocks taken back, recomputed later)",
                                          labels=["version"])
        steps = CounterMetricFamily("inference_steps", "steps of the step loop", labels=["version"])
        tokens = CounterMetricFamily("inference_step_tokens", "tokens computed by the steps (rate over inference_steps: tokens per step)",
                                     labels=["version", "kind"])
        lookups = CounterMetricFamily("inference_prefix_cache_lookup_tokens",
                                      "tokens of the sequences that looked for a cached prefix when they were admitted", labels=["version"])
        hits = CounterMetricFamily("inference_prefix_cache_hit_tokens",
                                   "of those, tokens found already computed (rate over the lookups: the hit rate)", labels=["version"])
        cached = GaugeMetricFamily("inference_prefix_cache_blocks", "KV blocks findable by their tokens, held or free",
                                   labels=["version"])
        for name, backend in loaded:
            scheduler = backend.step_thread.scheduler
            stats, manager = scheduler.stats, scheduler.manager
            sequences.add_metric([name, "running"], len(scheduler.running))
            sequences.add_metric([name, "waiting"], backend.waiting)
            blocks.add_metric([name, "used"], manager.used_blocks)
            blocks.add_metric([name, "free"], manager.free_blocks)
            preemptions.add_metric([name], stats.preemptions)
            steps.add_metric([name], stats.steps)
            tokens.add_metric([name, "prefill"], stats.prefill_tokens)
            tokens.add_metric([name, "decode"], stats.decode_tokens)
            lookups.add_metric([name], manager.lookups_tokens)
            hits.add_metric([name], manager.hits_tokens)
            cached.add_metric([name], manager.cached_blocks)
        yield from (sequences, blocks, preemptions, steps, tokens, lookups, hits, cached)
        yield histogram_family("inference_time_to_first_token_seconds", "from arrival to the first token (successful requests)",
                                  ["version"], (([name], backend.latencies.ttft) for name, backend in loaded))
        yield histogram_family("inference_time_per_output_token_seconds",
                                  "decode time over the tokens after the first (successful requests of two tokens or more)",
                                  ["version"], (([name], backend.latencies.tpot) for name, backend in loaded))
