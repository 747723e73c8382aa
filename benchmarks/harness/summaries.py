"""From one Locust level's per-request records to the level's figures: percentiles, stages, samples.

The harness's load generator (:mod:`benchmarks.harness.loadgen`) hands every level's raw records
here; what comes back is a :class:`~benchmarks.harness.results.LevelResult` (closed loop) or an
:class:`~benchmarks.harness.results.OpenLoopLevel` (open loop), ready to be saved.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import numpy as np

from benchmarks.harness.results import (
    MAX_REQUEST_SAMPLES,
    Latency,
    LevelResult,
    OpenLoopLevel,
    RequestSamples,
    StageSummary,
)

MAX_FAILURE_REASONS = 5


def percentile_ms(latencies_s: list[float], q: float) -> float:
    """The ``q``-th percentile in ms, linear interpolation between order statistics (numpy's default)."""
    return float(np.percentile(np.asarray(latencies_s) * 1e3, q))


def _timings(record: list) -> dict[str, float] | None:
    """The server's ``timings_ms`` of a record (index 6), ``None`` where the record has none."""
    return record[6] if len(record) > 6 and isinstance(record[6], dict) else None


def _prompt_tokens(record: list) -> int | None:
    return record[7] if len(record) > 7 else None


def summarize_stages(records: list[list]) -> dict[str, StageSummary] | None:
    """Per-stage percentiles over the records' ``timings_ms``; ``None`` when no record carries any.

    A stage missing from some answers (a fallback path without ``queue``) is summarised over the
    answers that have it; ``count`` says how many.
    """
    values: dict[str, list[float]] = {}
    for record in records:
        for stage, ms in (_timings(record) or {}).items():
            if isinstance(ms, (int, float)):
                values.setdefault(stage, []).append(float(ms))
    if not values:
        return None
    return {
        stage: StageSummary(
            count=len(ms), p50=float(np.percentile(ms, 50)), p90=float(np.percentile(ms, 90)),
            p99=float(np.percentile(ms, 99)), mean=float(np.mean(ms)),
        )
        for stage, ms in values.items()
    }


def evenly_chosen(items: list, limit: int) -> list:
    """At most ``limit`` of ``items``, spread evenly over the list (first and last kept), order kept."""
    if limit <= 0:
        return []
    if len(items) <= limit:
        return list(items)
    if limit == 1:
        return [items[0]]
    step = (len(items) - 1) / (limit - 1)
    return [items[round(i * step)] for i in range(limit)]


def sample_requests(records: list[list], window_start: float, limit: int = MAX_REQUEST_SAMPLES) -> RequestSamples | None:
    """Up to ``limit`` of ``records`` (successful ones), evenly by finishing time, as columns; rounded to 0.1 ms."""
    if not records:
        return None
    chosen = evenly_chosen(sorted(records, key=lambda r: r[0] + r[1]), limit)
    stages = sorted({stage for r in chosen for stage in (_timings(r) or {})})
    return RequestSamples(
        finished_s=[round(r[0] + r[1] - window_start, 3) for r in chosen],
        latency_ms=[round(r[1] * 1e3, 1) for r in chosen],
        prompt_tokens=[_prompt_tokens(r) for r in chosen],
        stages_ms={
            stage: [None if (_timings(r) or {}).get(stage) is None else round(float(_timings(r)[stage]), 1) for r in chosen]
            for stage in stages
        },
    )


def latency_summary(latencies_s: list[float]) -> Latency | None:
    if not latencies_s:
        return None
    return Latency(
        p50=percentile_ms(latencies_s, 50), p90=percentile_ms(latencies_s, 90), p95=percentile_ms(latencies_s, 95),
        p99=percentile_ms(latencies_s, 99), max=max(latencies_s) * 1e3, mean=float(np.mean(latencies_s)) * 1e3,
    )


def summarize_level(
    records: list[list],
    window_start: float,
    window_end: float,
    *,
    users: int,
    stopped_by: Literal["request_target", "time_limit"],
    locust_exit_code: int,
    resources: dict[str, float | None] | None = None,
    extras: dict | None = None,
) -> LevelResult:
    """The level's figures from Locust's records
    ``[start, latency_s, status, ok, tokens, reason, timings_ms, prompt_tokens]`` (the last two optional).

    Contract:
    - the window opens once every user has had its first answer (the locustfile's steady state), so
      the first round of requests, sent all at once and queued behind fewer others, is left out;
    - throughput counts requests *finished* inside ``[window_start, window_end]``: every user is busy
      throughout, so completions per second are the server's rate at ``users``;
    - latency percentiles, stage summaries and the request sample are taken over the same successful
      requests (every one a second-round or later request, since the first round has finished when the
      window opens);
    - failures are counted by status, ``0`` meaning no HTTP answer at all.
    ``extras``: the level's other schema-2 fields (``server_series``, ``resource_series``).
    """
    window_s = max(window_end - window_start, 1e-9)
    finished = [r for r in records if window_start <= r[0] + r[1] <= window_end]
    ok = [r for r in finished if r[3]]
    failed = [r for r in finished if not r[3]]
    resources = resources or {}
    return LevelResult(
        users=users,
        window_s=window_s,
        stopped_by=stopped_by,
        requests_ok=len(ok),
        requests_failed=len(failed),
        latency_sample=len(ok),
        qps=len(ok) / window_s,
        tokens_per_s=sum(r[4] for r in ok) / window_s,
        latency_ms=latency_summary([r[1] for r in ok]),
        errors_by_status=dict(sorted(Counter(str(r[2]) for r in failed).items())),
        failure_reasons=dict(Counter(str(r[5]) for r in failed).most_common(MAX_FAILURE_REASONS)),
        locust_exit_code=locust_exit_code,
        stages_ms=summarize_stages(ok),
        samples=sample_requests(ok, window_start),
        **resources,
        **(extras or {}),
    )


def summarize_open_level(
    records: list[list],
    window_start: float,
    window_end: float,
    *,
    offered_rps: float,
    dropped_at: list[float],
    unfinished_at: list[float],
    max_outstanding_seen: int,
    slo_ms: float,
    locust_exit_code: int,
    resources: dict[str, float | None] | None = None,
    extras: dict | None = None,
) -> OpenLoopLevel:
    """One offered rate's figures. ``records`` are the requests that *arrived* (were sent) inside
    ``[window_start, window_end)``, answered or failed; the arrival times ``dropped_at`` (refused by the
    outstanding cap) and ``unfinished_at`` (unanswered when the drain ended) inside the window count as
    failures too (statuses ``dropped`` and ``0``).

    The achieved rate (``qps``, and ``tokens_per_s``) counts the successful answers that *finished*
    inside the window, whenever they arrived: the server's output while the load was offered, to be
    compared with ``arrival_rps`` (a Poisson draw strays from the nominal rate). Goodput counts the
    successful requests among the window's arrivals answered within ``slo_ms``, per second of the
    window; latency percentiles are over the successful ones among those arrivals.
    """
    window_s = max(window_end - window_start, 1e-9)
    measured = [r for r in records if window_start <= r[0] < window_end]
    ok = [r for r in measured if r[3]]
    failed = [r for r in measured if not r[3]]
    delivered = [r for r in records if r[3] and window_start <= r[0] + r[1] <= window_end]
    dropped = sum(1 for t in dropped_at if window_start <= t < window_end)
    unfinished = sum(1 for t in unfinished_at if window_start <= t < window_end)
    errors = Counter(str(r[2]) for r in failed)
    reasons = Counter(str(r[5]) for r in failed)
    if dropped:
        errors["dropped"] += dropped
        reasons["dropped: too many requests in flight"] += dropped
    if unfinished:
        errors["0"] += unfinished
        reasons["unanswered when the drain ended"] += unfinished
    resources = resources or {}
    arrivals = len(measured) + dropped + unfinished
    return OpenLoopLevel(
        offered_rps=offered_rps,
        window_s=window_s,
        arrivals=arrivals,
        arrival_rps=arrivals / window_s,
        dropped=dropped,
        unfinished=unfinished,
        requests_ok=len(ok),
        requests_failed=len(failed) + dropped + unfinished,
        latency_sample=len(ok),
        qps=len(delivered) / window_s,
        goodput_rps=sum(1 for r in ok if r[1] * 1e3 <= slo_ms) / window_s,
        tokens_per_s=sum(r[4] for r in delivered) / window_s,
        latency_ms=latency_summary([r[1] for r in ok]),
        errors_by_status=dict(sorted(errors.items())),
        failure_reasons=dict(reasons.most_common(MAX_FAILURE_REASONS)),
        max_outstanding_seen=max_outstanding_seen,
        locust_exit_code=locust_exit_code,
        stages_ms=summarize_stages(ok),
        samples=sample_requests(ok, window_start),
        **resources,
        **(extras or {}),
    )
