"""Made-up but schema-valid results: for the report's tests, the notebook's test, and trying the report offline.

Every figure is given by the caller, so a test can compute what the report must say by hand.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.results import (
    BenchmarkResult,
    Calibration,
    Environment,
    Latency,
    LevelResult,
    MatmulRate,
    OpenLoopConfig,
    OpenLoopLevel,
    OpenLoopResult,
    ResourcePoint,
    RunConfig,
    ServerRun,
    ServerSeries,
    save_result,
)
from benchmarks.harness.summaries import sample_requests, summarize_stages


@dataclass(frozen=True)
class SyntheticLevel:
    users: int
    qps: float
    p50_ms: float
    p99_ms: float
    errors_by_status: dict[str, int] = field(default_factory=dict)
    loadgen_cpu_percent: float = 10.0
    latency_sample: int = 500


def synthetic_environment() -> Environment:
    return Environment(
        git_commit="0" * 40, git_dirty=False, python="3.11.0", torch="2.13.0", locust="2.47.0", platform="Linux",
        cpu_model="Synthetic CPU", logical_cores=2, physical_cores=2, gpu=None, cuda=None,
        load_average_at_start=[0.0, 0.0, 0.0], torch_threads=1, thread_env={"OMP_NUM_THREADS": "1"},
        pinning=True, server_cores=[0], loadgen_cores=[1],
    )


def synthetic_result(
    chapter: str, levels: Sequence[SyntheticLevel], *, label: str | None = None, profile: str = "cpu",
    workload: str = "default", max_new_tokens: int = 32, target_requests: int = 200,
) -> BenchmarkResult:
    """A result whose levels carry exactly the given QPS and latencies (tokens/s = QPS x max_new_tokens)."""
    label = label or chapter
    return BenchmarkResult(
        chapter=chapter,
        label=label,
        started_at="2026-01-01T00:00:00+00:00",
        finished_at="2026-01-01T00:01:00+00:00",
        environment=synthetic_environment(),
        config=RunConfig(
            profile=profile, workload=workload, max_new_tokens=max_new_tokens, prompt_lengths=[16, 32, 64, 128],
            seed=1234, levels=[lvl.users for lvl in levels], min_level_s=6.0, max_level_s=25.0,
            target_requests=target_requests, warmup_requests=8, server_args=["--weights=default"],
            server_command=["python", "-m", f"chapters.{chapter}"],
            reproduce=f"python -m benchmarks run --chapter {chapter} --profile {profile}"
            + ("" if label == chapter else f" --label {label}"),
        ),
        server=ServerRun(startup_s=1.0, warmup_s=0.5, exit_code=0),
        levels=[
            LevelResult(
                users=lvl.users, window_s=10.0, stopped_by="request_target",
                requests_ok=int(lvl.qps * 10), requests_failed=sum(lvl.errors_by_status.values()),
                latency_sample=lvl.latency_sample, qps=lvl.qps, tokens_per_s=lvl.qps * max_new_tokens,
                latency_ms=Latency(p50=lvl.p50_ms, p90=lvl.p99_ms * 0.9, p95=lvl.p99_ms * 0.95, p99=lvl.p99_ms,
                                   max=lvl.p99_ms * 1.1, mean=lvl.p50_ms),
                errors_by_status=dict(lvl.errors_by_status), failure_reasons={},
                loadgen_cpu_percent=lvl.loadgen_cpu_percent, server_cpu_percent=95.0,
                server_rss_mb_max=300.0, server_rss_mb_mean=290.0, locust_exit_code=0,
            )
            for lvl in levels
        ],
    )


def write_synthetic_climb(directory: Path) -> dict[str, Path]:
    """A plausible two-chapter climb (ch01, ch02) plus a variant (ch01-workers) in ``directory``."""
    runs = {
        "ch01": synthetic_result("ch01", [SyntheticLevel(1, 20, 50, 60), SyntheticLevel(8, 21, 380, 420),
                                          SyntheticLevel(32, 21, 1500, 1600), SyntheticLevel(64, 20, 3000, 3300)]),
        "ch02": synthetic_result("ch02", [SyntheticLevel(1, 22, 45, 55), SyntheticLevel(8, 25, 320, 360),
                                          SyntheticLevel(32, 25, 1280, 1350), SyntheticLevel(64, 25, 2560, 2700)]),
        "ch01-workers": synthetic_result("ch01", [SyntheticLevel(1, 19, 52, 65), SyntheticLevel(8, 20, 400, 450)],
                                         label="ch01-workers"),
    }
    return {label: save_result(result, directory) for label, result in runs.items()}


# --------------------------------------------------------------------------------------------
# Schema-2 synthetic results: stage timings, request samples, batch sizes, series, calibration,
# open-loop sweeps. Made up from a simple queueing story, reproducible (seeded), for the notebooks'
# tests and for trying the plots offline. Never mistake them for measurements: their environment
# says "Synthetic CPU".
# --------------------------------------------------------------------------------------------

# Per chapter: (capacity in requests/s at saturation, time of one request alone in ms, batches?, pool?)
SYNTHETIC_CHAPTERS: dict[str, tuple[float, float, bool, bool]] = {
    "ch01": (20.0, 50.0, False, False),
    "ch02": (22.0, 48.0, False, False),
    "ch03": (50.0, 58.0, True, False),
    "ch04": (55.0, 57.0, True, True),
    "ch05": (70.0, 55.0, True, True),
    "ch06": (80.0, 52.0, True, True),
    "ch08": (85.0, 50.0, True, False),  # batches: its step records stand in for a batcher's figures
}
SYNTHETIC_LEVELS = (1, 8, 32, 64)
SYNTHETIC_RATES = (2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0)


def synthetic_calibration(scale: float = 1.0) -> Calibration:
    """A calibration whose every figure is ``scale`` times a fixed one (so a test can predict ratios)."""
    rates = [
        MatmulRate(name=name, rows=rows, in_features=fan_in, out_features=fan_out,
                   fp32_gflops=(10.0 if rows == 1 else 60.0) * scale, bf16_gflops=(5.0 if rows == 1 else 40.0) * scale)
        for rows in (1, 64) for name, fan_in, fan_out in
        (("attn.c_attn", 256, 768), ("attn.c_proj", 256, 256), ("mlp.c_fc", 256, 1024), ("mlp.c_proj", 1024, 256),
         ("lm_head", 256, 258))
    ]
    return Calibration(
        model="synthetic", device="cpu", torch_threads=1, fp32_gflops={"1": 10.0 * scale, "64": 60.0 * scale},
        bf16_gflops={"1": 5.0 * scale, "64": 40.0 * scale}, matmuls=rates, engine_new_tokens=32,
        engine_rps={"1": 18.0 * scale, "64": 50.0 * scale}, seconds=4.0,
    )


def _stage_names(chapter: str) -> list[str]:
    if chapter in ("ch01", "ch02"):
        return ["parse", "queue", "inference", "total"]
    names = ["parse", "queue", "prefill", "decode", "batch", "total"]
    return ["admission", *names] if chapter >= "ch04" else names


def _batch_sizes(users: float, rng: random.Random) -> dict[str, int]:
    """A spread of batch sizes around ``users`` (capped at 64), about 60 batches."""
    sizes: dict[str, int] = {}
    for _ in range(60):
        size = max(1, min(64, round(rng.gauss(max(1.0, users * 0.7), max(0.5, users * 0.2)))))
        sizes[str(size)] = sizes.get(str(size), 0) + 1
    return dict(sorted(sizes.items(), key=lambda item: int(item[0])))


def _requests(chapter: str, latencies_ms: list[float], window_s: float, rng: random.Random) -> tuple[list[list], float]:
    """Locust-like records (schema 2) finishing evenly inside ``[0, window_s]``, with made-up stages
    that add up: queue = total - compute."""
    records = []
    stages = _stage_names(chapter)
    for i, latency in enumerate(latencies_ms):
        finished = (i + 0.5) * window_s / len(latencies_ms)
        compute = min(latency * 0.95, SYNTHETIC_CHAPTERS[chapter][1] * rng.uniform(0.9, 1.1) * (1 + latency / 2000))
        timings = {"parse": 0.2, "queue": latency * 0.97 - compute, "total": latency * 0.97}
        if "inference" in stages:
            timings["inference"] = compute
        else:
            timings.update(prefill=compute * 0.2, decode=compute * 0.8, batch=compute)
        if "admission" in stages:
            timings["admission"] = 0.05
        prompt = rng.choice((16, 32, 64, 128))
        records.append([finished - latency / 1e3, latency / 1e3, 200, True, 32, None, timings, prompt])
    return records, 0.0


def _latencies(p50: float, p99: float, count: int, rng: random.Random) -> list[float]:
    """``count`` latencies whose spread runs from about p50 to p99 (a log-normal-ish shape)."""
    spread = max(p99 / p50, 1.0001)
    return sorted(p50 * spread ** (rng.gauss(0, 1) / 2.33) for _ in range(count))


def _resource_series(window_s: float, rss_mb: float) -> list[ResourcePoint]:
    return [ResourcePoint(t_s=t * 0.5 - 1.0, server_cpu_percent=95.0 if t > 1 else 30.0, loadgen_cpu_percent=5.0,
                          server_rss_mb=rss_mb + t * 0.1) for t in range(int(window_s * 2) + 3)]


def _step_records(users: float, rng: random.Random, count: int = 64) -> list[dict[str, float]]:
    """Chapter 8's step records: every running sequence decodes, a few steps also prefill a prompt."""
    rows = min(64, int(users))
    records = []
    for _ in range(count):
        prefill = rng.choice((0, 0, 0, 16, 64, 128)) if users > 1 else rng.choice((0, 32))
        model = 2.0 + 0.25 * rows + 0.05 * prefill
        records.append({"tokens": rows + prefill, "decode_rows": rows, "prefill_tokens": prefill, "running": rows,
                        "schedule_ms": 0.05 + 0.004 * rows, "prepare_ms": 0.2 + 0.01 * rows, "model_ms": model,
                        "update_ms": 0.05 + 0.004 * rows})
    return records


def _server_series(chapter: str, users: float, window_s: float, rng: random.Random) -> ServerSeries | None:
    _, _, batches, pool = SYNTHETIC_CHAPTERS[chapter]
    if chapter == "ch08":
        points = [{"t_s": t * 0.5, "scheduler.steps": float(t * 20), "scheduler.running": min(64.0, users)}
                  for t in range(int(window_s * 2) + 2)]
        return ServerSeries(source="stats", interval_s=0.5, points=points, steps=_step_records(users, rng))
    if not batches:
        return None
    sizes = _batch_sizes(users, rng)
    points = []
    for t in range(int(window_s * 2) + 2):
        point = {"t_s": t * 0.5, "batcher.batches": float(t * 3), "batcher.requests": float(t * 3 * users * 0.7)}
        if pool:
            reserved = min(1.0, users / 64) * 0.8 + rng.uniform(0, 0.05)
            point.update({"pool.use": reserved * 0.6, "pool.written_share": 0.6, "pool.blocks_used": 400 * reserved * 0.6,
                          "pool.slots_reserved_total": t * 1000.0 * users, "pool.slots_written_total": t * 600.0 * users,
                          "admission.rejected_total": float(t if users >= 64 else 0),
                          "admission.fallback_served_total": float(t // 2 if users >= 32 else 0)})
        points.append(point)
    constants = {"pool.blocks_total": 400.0, "admission.capacity_blocks": 400.0} if pool else {}
    return ServerSeries(source="stats", interval_s=0.5, batch_sizes=sizes, batches=sum(sizes.values()),
                        requests=sum(int(k) * v for k, v in sizes.items()), points=points, constants=constants)


def rich_synthetic_result(chapter: str, *, label: str | None = None, workload: str = "default", profile: str = "cpu",
                          levels: Sequence[int] = SYNTHETIC_LEVELS, calibration_scale: float = 1.0,
                          seed: int = 0) -> BenchmarkResult:
    """A closed-loop result with every schema-2 field, from the chapter's made-up capacity and service time."""
    capacity, alone_ms, _, _ = SYNTHETIC_CHAPTERS[chapter]
    max_new = 256 if workload == "long" else 32
    if workload == "long":
        capacity, alone_ms = capacity / 6, alone_ms * 8
    rng = random.Random(f"{chapter}-{label}-{workload}-{seed}")
    plain = []
    for users in levels:
        qps = min(capacity, users * 1e3 / alone_ms) * rng.uniform(0.97, 1.03)
        p50 = max(alone_ms, users * 1e3 / qps)
        plain.append(SyntheticLevel(users, qps, p50, p50 * 1.4))
    result = synthetic_result(chapter, plain, label=label, profile=profile, workload=workload, max_new_tokens=max_new)
    enriched = []
    for level, spec in zip(result.levels, plain, strict=True):
        records, window_start = _requests(chapter, _latencies(spec.p50_ms, spec.p99_ms, 400, rng), 10.0, rng)
        ok = [r for r in records if r[3]]
        enriched.append(level.model_copy(update={
            "stages_ms": summarize_stages(ok), "samples": sample_requests(ok, window_start),
            "server_series": _server_series(chapter, spec.users, 10.0, rng),
            "resource_series": _resource_series(10.0, 300.0 + spec.users),
        }))
    return result.model_copy(update={"levels": enriched, "calibration": synthetic_calibration(calibration_scale)})


def synthetic_open_loop(chapter: str, *, label: str | None = None, profile: str = "cpu",
                        rates: Sequence[float] = SYNTHETIC_RATES, stop_p99_ms: float = 3000.0,
                        calibration_scale: float = 1.0) -> OpenLoopResult:
    """An open-loop sweep of a server with the chapter's made-up capacity: latency ``alone / (1 - load)``
    below it, a growing backlog above it; the sweep stops like the harness's once P99 passes ``stop_p99_ms``."""
    capacity, alone_ms, _, _ = SYNTHETIC_CHAPTERS[chapter]
    base = synthetic_result(chapter, [SyntheticLevel(1, 1, 1, 1)], label=label, profile=profile)
    rng = random.Random(f"open-{chapter}-{label}")
    levels, stopped = [], None
    for rate in rates:
        load = rate / capacity
        p50 = alone_ms / (1 - load) if load < 0.95 else alone_ms * 20 * load
        p99 = p50 * (1.5 if load < 0.7 else 3.0)
        achieved = min(rate, capacity * 0.98)
        window_s = 10.0
        arrivals = round(rate * window_s)
        ok = round(achieved * window_s)
        records, start = _requests(chapter, _latencies(p50, p99, max(ok, 2), rng), window_s, rng)
        levels.append(OpenLoopLevel(
            offered_rps=rate, window_s=window_s, arrivals=arrivals, arrival_rps=arrivals / window_s,
            dropped=max(0, arrivals - ok), unfinished=0, requests_ok=ok, requests_failed=max(0, arrivals - ok),
            latency_sample=ok, qps=achieved, goodput_rps=achieved if p99 < 1000 else achieved * 0.3,
            tokens_per_s=achieved * 32, latency_ms=Latency(p50=p50, p90=p99 * 0.9, p95=p99 * 0.95, p99=p99,
                                                             max=p99 * 1.1, mean=p50 * 1.05),
            errors_by_status={"dropped": arrivals - ok} if arrivals > ok else {},
            failure_reasons={"dropped: too many requests in flight": arrivals - ok} if arrivals > ok else {},
            max_outstanding_seen=min(256, round(rate * p50 / 1e3) + 1), locust_exit_code=0,
            server_cpu_percent=min(100.0, 100 * load), loadgen_cpu_percent=3.0,
            stages_ms=summarize_stages(records), samples=sample_requests(records, start),
            server_series=_server_series(chapter, min(64.0, rate * p50 / 1e3), window_s, rng),
            resource_series=_resource_series(window_s, 300.0),
        ))
        if p99 > stop_p99_ms or (arrivals - ok) / arrivals > 0.05:
            stopped = f"P99 {p99:.0f} ms at {rate:g}/s exceeds {stop_p99_ms:.0f} ms"
            break
    config = OpenLoopConfig(
        profile=profile, workload="default", max_new_tokens=32, prompt_lengths=[16, 32, 64, 128], seed=1234,
        rates=list(rates), lead_in_s=1.0, min_level_s=6.0, max_level_s=12.0, target_requests=150, drain_s=8.0,
        max_outstanding=256, slo_ms=1000.0, stop_p99_ms=stop_p99_ms, stop_error_share=0.05,
        server_args=["--weights=default"], server_command=["python", "-m", f"chapters.{chapter}"],
        reproduce=f"python -m benchmarks openloop --chapters {chapter} --profile {profile}",
    )
    return OpenLoopResult(
        chapter=chapter, label=label or chapter, started_at=base.started_at, finished_at=base.finished_at,
        environment=base.environment, config=config, server=base.server, levels=levels, stopped=stopped,
        calibration=synthetic_calibration(calibration_scale),
    )


def write_synthetic_reference(directory: Path, profile: str = "cpu", calibration_scale: float = 1.0) -> list[Path]:
    """A whole made-up reference directory with every schema-2 field: ch01..ch06, the long workload of
    ch03/ch04, the variants the notebooks plot (ch01-workers, ch05-fp32) and every chapter's open-loop
    sweep. Returns the files written."""
    paths = []
    for chapter in SYNTHETIC_CHAPTERS:
        paths.append(save_result(rich_synthetic_result(chapter, profile=profile, calibration_scale=calibration_scale),
                                 directory))
        paths.append(save_result(synthetic_open_loop(chapter, profile=profile, calibration_scale=calibration_scale),
                                 directory))
    for chapter in ("ch03", "ch04"):
        paths.append(save_result(rich_synthetic_result(chapter, workload="long", profile=profile,
                                                       calibration_scale=calibration_scale), directory))
    for chapter, label in (("ch01", "ch01-workers"), ("ch05", "ch05-fp32")):
        paths.append(save_result(rich_synthetic_result(chapter, label=label, profile=profile, seed=1,
                                                       calibration_scale=calibration_scale), directory))
    return paths


# --------------------------------------------------------------------------------------------
# Chapters 7 and 8: a drain timeline, the leak check's curves, a streaming comparison. Built with
# the recorders' own types and summaries, so their files and these cannot drift apart.
# --------------------------------------------------------------------------------------------


def synthetic_drain_timeline(clients: int = 4, request_s: float = 0.8, exit_s: float = 0.9,
                             poll_interval_s: float = 0.05) -> dict:
    """A drain as chapter 7 should do it: ``clients`` closed-loop clients from -3 s, SIGTERM at 0 (their
    requests then in flight are answered), 503 for every new request, no connection once the process is gone."""
    from dataclasses import asdict

    from benchmarks.studies.drain_timeline.drain_timeline import (
        KIND,
        NO_CONNECTION,
        SCHEMA,
        Poll,
        RequestSpan,
        Timeline,
    )

    spans = []
    for client in range(clients):
        start = -3.0 + client * request_s / clients
        while start < 0:  # accepted before the signal: answered
            spans.append(RequestSpan(round(start, 4), round(start + request_s, 4), 200))
            start += request_s
        start = spans[-1].end_s
        while start < exit_s:  # refused during the drain, a 0.2 s pause between tries
            spans.append(RequestSpan(round(start, 4), round(start + 0.01, 4), 503))
            start += 0.21
        spans.append(RequestSpan(round(start, 4), round(start + 0.01, 4), NO_CONNECTION))
    drained_s = max(s.end_s for s in spans if s.status == 200)
    polls = []
    for tick in range(round((3.0 + exit_s) / poll_interval_s)):
        t = -3.0 + tick * poll_interval_s
        if t >= drained_s + 0.1:
            polls.append(Poll(round(t, 4), None, None, None, None))
            continue
        in_flight = sum(1 for s in spans if s.status == 200 and s.start_s <= t < s.end_s)
        polls.append(Poll(round(t, 4), 200 if t < 0 else 503, t < 0, "ok" if t < 0 else "draining", in_flight))
    log = [{"t_s": 0.001, "message": "SIGTERM received"},
           {"t_s": 0.002, "message": f"draining: {clients} requests in flight, waiting up to 20.0 s"},
           {"t_s": drained_s, "message": f"drained in {drained_s:.2f} s: every accepted request was answered"},
           {"t_s": exit_s - 0.05, "message": "Finished server process [1]"}]
    return asdict(Timeline(
        kind=KIND, schema=SCHEMA, started_at="2026-01-01T00:00:00+00:00", command="synthetic",
        server_command=["python", "-m", "chapters.ch07_production"], clients=clients, max_new_tokens=64,
        load_before_s=3.0, poll_interval_s=poll_interval_s, drain_timeout_s=20.0, retry_pause_s=0.2,
        python="3.11.0", platform="Synthetic", exit_s=exit_s, exit_code=0, drain_log=log, requests=spans, polls=polls,
    ))


def synthetic_leak_report(lesson: str, requests: int = 1000, fail_share: float = 0.2, samples: int = 10,
                          leaked_mb_per_failure: float = 0.5) -> dict:
    """The leak check's JSON for ``lesson``: with ``leaky`` every failed request keeps
    ``leaked_mb_per_failure`` of tensors alive; with ``fixed`` memory stays flat."""
    from dataclasses import fields

    from chapters.ch07_production.leakcheck import LeakReport

    series = []
    for share in range(samples + 1):
        sent = requests * share // samples
        failed = round(sent * fail_share)
        leaked = failed * leaked_mb_per_failure if lesson == "leaky" else 0.0
        wobble = 0.3 * (share % 2)
        series.append({"requests": sent, "failed": failed, "rss_mb": 400.0 + leaked + 2 * wobble, "device_mb": None,
                       "python_heap_mb": 20.0 + 0.01 * failed + wobble / 10, "live_tensor_mb": 60.0 + leaked})
    per_1000 = 1000 / requests
    growth = {key: round((series[-1][key] - series[0][key]) * per_1000, 3)
              for key in ("rss_mb", "python_heap_mb", "live_tensor_mb")}
    report = {
        "leak_lesson": lesson, "requests": requests, "failed": series[-1]["failed"],
        "statuses": {"200": requests - series[-1]["failed"], "504": series[-1]["failed"]},
        "rss_growth_mb_per_1000": growth["rss_mb"], "device_growth_mb_per_1000": None,
        "python_heap_growth_mb_per_1000": growth["python_heap_mb"],
        "live_tensor_growth_mb_per_1000": growth["live_tensor_mb"], "threshold_mb": 8.0, "series": series,
    }
    assert set(report) == {f.name for f in fields(LeakReport)}, "the leak check's report changed: update this"
    judged = max(growth["live_tensor_mb"], growth["python_heap_mb"])
    return {**report, "leaking": judged > report["threshold_mb"], "fail_share": fail_share, "warmup": 200,
            "concurrency": 8, "device": "cpu", "command": "synthetic"}


# Per chapter of the streaming comparison: (seconds to the first token, seconds per further token,
# whether it streams). A request-level batch answers all at once, held by its longest member.
SYNTHETIC_STREAMING = {"ch06": (0.0, 0.0, False), "ch08": (0.08, 0.012, True)}


def synthetic_streaming_comparison(workload: str = "mixed", users: int = 8, duration_s: float = 10.0,
                                   seed: int = 0) -> dict:
    """``benchmarks.harness.streaming compare``'s JSON for ch06 against ch08, from made-up token timings
    summarised by the tool's own :func:`benchmarks.harness.streaming.summarize`."""
    from benchmarks.harness.streaming import (
        WORKLOADS,
        RequestRecord,
        compare_document,
        summarize,
    )

    rng = random.Random(f"streaming-{workload}-{seed}")
    chapters = {}
    for chapter, (first_s, per_token_s, streams) in SYNTHETIC_STREAMING.items():
        records = []
        for _ in range(users * 12):
            new_tokens = WORKLOADS[workload](rng)["max_new_tokens"]
            sent = rng.uniform(0, duration_s)
            if streams:
                times = [sent + first_s + i * per_token_s * rng.uniform(0.8, 1.2) for i in range(new_tokens)]
            else:  # a request-level batch: everyone waits for the longest (256 tokens at most) in the batch
                times = [sent + 0.1 + 0.015 * max(new_tokens, rng.choice((32, 64, 128, 256)))]
            records.append(RequestRecord(sent=sent, status=200, token_times=times if streams else [], ended=times[-1],
                                         output_tokens=new_tokens))
        chapters[chapter] = {"streamed": streams, **summarize(records, duration_s, None, None, None)}
    return compare_document(workload, users, duration_s, chapters, "synthetic")


# Chapter 8 with prefix caching on and off, per variant: (seconds to the first token, seconds per further
# token), on a workload whose prompts share prefixes and on one whose prompts share nothing (where the two
# variants do the same work).
SYNTHETIC_PREFIX_CACHING = {
    True: {"caching-on": (0.05, 0.012), "caching-off": (0.2, 0.014)},
    False: {"caching-on": (0.08, 0.012), "caching-off": (0.08, 0.012)},
}


def synthetic_prefix_caching_comparison(workload: str = "shared-prefix", users: int = 8, duration_s: float = 10.0,
                                        rounds: int = 2, seed: int = 0) -> dict:
    """``benchmarks.harness.streaming compare``'s JSON for chapter 8's two prefix-caching variants on ``workload``, over
    ``rounds`` rounds, from made-up token timings summarised and kept by the tool's own functions. A closed loop:
    each user sends as many requests as fit in ``duration_s`` at its variant's pace."""
    from benchmarks.harness.streaming import (
        PREFIX_CACHING_VARIANTS,
        WORKLOADS,
        RequestRecord,
        Variant,
        compare_document,
        median_round,
        summarize,
    )

    rng = random.Random(f"prefix-caching-{workload}-{seed}")
    timings = SYNTHETIC_PREFIX_CACHING[workload == "shared-prefix"]
    chapters = {}
    for label, (first_s, per_token_s) in timings.items():
        runs = []
        for _ in range(rounds):
            records = []
            for _ in range(users):
                sent = 0.0
                while True:
                    new_tokens = WORKLOADS[workload](rng)["max_new_tokens"]
                    times = [sent + first_s * rng.uniform(0.8, 1.2) + i * per_token_s * rng.uniform(0.8, 1.2)
                             for i in range(new_tokens)]
                    if times[-1] > duration_s:
                        break
                    records.append(RequestRecord(sent=sent, status=200, token_times=times, ended=times[-1],
                                                 output_tokens=new_tokens))
                    sent = times[-1]
            runs.append({"streamed": True, **summarize(records, duration_s, None, None, None)})
        chapters[label] = median_round(runs)
    variants = [Variant(label, "ch08", (flag,)) for label, flag in PREFIX_CACHING_VARIANTS.items()]
    return compare_document(workload, users, duration_s, chapters, "synthetic", variants=variants, rounds=rounds)


def synthetic_scale_out_timeline(scenario: str, replicas: int = 2, clients: int = 6, back_s: float = 6.0) -> dict:
    """A chapter 9 timeline (``benchmarks.studies.scale_out_timeline.scale_out_timeline``): ``drill`` kills a replica at 0 s and has
    ``replicas`` running again at ``back_s``; ``autoscale`` steps the clients up and down, one replica added."""
    from dataclasses import asdict

    from benchmarks.studies.scale_out_timeline.scale_out_timeline import KINDS, SCHEMA, Poll, RequestSpan, Timeline, account, summarize_load

    drill = scenario == "drill"
    steps = [(20.0, clients)] if drill else [(10.0, 1), (20.0, clients), (15.0, 1)]
    start_s = -5.0 if drill else 0.0
    end_s = start_s + sum(seconds for seconds, _ in steps)
    spans, polls = [], []
    for client in range(clients):
        t, stream = start_s, client % 2 == 0
        while t < end_s:
            if not drill and not any(client < n for _, n in steps):
                break
            end = t + 0.8 + 0.1 * client
            outcome, detail = "ok", ""
            if drill and t <= 0 <= end and client < 2:
                outcome, detail = ("contract_error", "replica_failed") if stream else ("replayed", "")
            spans.append(RequestSpan(round(t, 3), round(end, 3), stream, 200 if outcome != "contract_error" or stream else 500,
                                     outcome, detail))
            t, stream = end, not stream
    t = start_s
    while t < end_s:
        if drill:
            running = replicas if t < 0.5 or t >= back_s else replicas - 1
            pids = [100, 101] if t < 0 else ([101] if t < 1.0 else [101, 102])
        else:
            running = 2 if 14.0 <= t < 36.0 else 1
            pids = [100] if t < 11.0 or t >= 37.0 else [100, 102]
        polls.append(Poll(round(t, 3), running, pids))
        t += 0.25
    timeline = Timeline(
        kind=KINDS[scenario], schema=SCHEMA, started_at="2026-01-01T00:00:00+00:00", command="synthetic",
        server_args=["--num-replicas", str(replicas if drill else 1), "--replica-cpus", "0.5"], steps=steps,
        max_new_tokens=64, poll_interval_s=0.25, python="3", platform="synthetic", cpu_count=2,
        killed_pid=100 if drill else None, killed_at_s=5.0 if drill else None,
        replica_startups={"102": {"process_started_s": 0.4 if drill else 11.0,
                                  "log": [{"t_s": back_s - 1.0 if drill else 13.0, "message": "engine eager/bf16 on cpu: ready in 0.1 s"},
                                          {"t_s": back_s - 0.5 if drill else 13.5, "message": "model version v1 (synthetic) serving"}]}},
        requests=spans, polls=polls)
    timeline.accounting = account(spans, polls, replicas) if drill else summarize_load(spans)
    return asdict(timeline)


def synthetic_replicas_and_routers(workload: str = "mixed") -> dict:
    """``benchmarks.studies.replicas_and_routers.scale_out_compare``'s document with every configuration and plausible medians."""
    from benchmarks.studies.replicas_and_routers.scale_out_compare import CH08, CONFIGS, KIND, SCHEMA

    configs = {}
    for index, (label, (module, flags, _env)) in enumerate(CONFIGS.items()):
        cores = {"server": 0.95} if module == CH08 else {"replicas": 0.9, "Serve's proxy": 0.3, "Ray's other processes": 0.06,
                                                         "Serve's controller": 0.03, "server": 0.0}
        median = {"qps": 6.0 + index, "output_tokens_per_s": 400.0 + 30 * index, "ttft_ms_p50": 150.0, "ttft_ms_p99": 900.0,
                  "e2e_ms_p50": 3000.0 - 100 * index, "e2e_ms_p99": 9000.0 - 300 * index, "client_cores_busy": 0.2,
                  "server_cores_busy": cores}
        configs[label] = {"module": module, "flags": flags, "runs": [], "median": median}
    return {"kind": KIND, "schema": SCHEMA, "started_at": "2026-01-01T00:00:00+00:00", "command": "synthetic",
            "git_commit": None, "git_dirty": False, "workload": workload, "users": 32, "duration_s": 20.0, "rounds": 2,
            "server_args": "--torch-threads 1", "python": "3", "platform": "synthetic", "configs": configs}


def synthetic_simulation() -> dict:
    """A small ``benchmarks.studies.scale_out_simulation.sweep`` document: the ``mixed`` points the notebook plots."""
    routers, replicas = ["random", "pow2", "least-tokens"], [1, 2, 4]
    points = []
    for utilisation in (0.5, 0.85, 0.95):
        for router in routers:
            for n in replicas:
                spread = 1.0 if router == "random" else 1.0 / n
                points.append({"mix": "mixed", "router": router, "replicas": n, "utilisation": utilisation,
                               "offered_rps": 10.0 * n * utilisation, "throughput_rps": 10.0 * n * utilisation,
                               "latency_ms": {"p50": 800.0, "p90": 2000.0, "p99": 3000.0 + 4000.0 * utilisation * spread},
                               "ttft_ms": {"p50": 30.0, "p99": 60.0 + 1000.0 * max(0.0, utilisation - 0.9) * 20 * spread},
                               "goodput_rps": 10.0 * n * utilisation * (0.97 if router == "random" else 1.0)})
    return {"what": "synthetic", "command": "synthetic", "seed": 0, "assumptions": ["synthetic"],
            "settings": {"routers": routers, "replicas": replicas, "utilisations": [0.5, 0.85, 0.95],
                         "slo": {"ttft_ms": 1000.0, "tpot_ms": 100.0}},
            "mixes": {"mixed": {"capacity_rps_per_replica": 10.0}}, "points": points,
            "validation": {"one_replica_vs_open_loop": {"levels": []}}}


def write_synthetic_production_and_streaming(directory: Path) -> list[Path]:
    """The files chapters 7, 8 and 9's notebooks read, in ``directory/ch07/``, ``directory/streaming/``,
    ``directory/ch08/prefix-caching/`` and ``directory/ch09/``."""
    import json

    documents = {Path("ch07") / "drain-timeline.json": synthetic_drain_timeline()}
    documents[Path("ch09") / "failure-drill.json"] = synthetic_scale_out_timeline("drill")
    documents[Path("ch09") / "failure-drill-chapter-defaults.json"] = synthetic_scale_out_timeline("drill", back_s=14.0)
    documents[Path("ch09") / "failure-drill-spare-1.json"] = synthetic_scale_out_timeline("drill", replicas=3, back_s=10.0)
    documents[Path("ch09") / "autoscale-timeline.json"] = synthetic_scale_out_timeline("autoscale")
    documents[Path("ch09") / "replicas-and-routers.json"] = synthetic_replicas_and_routers()
    for workload in ("default", "mixed"):
        documents[Path("ch09") / f"serve-path-{workload}.json"] = synthetic_replicas_and_routers(workload)
    documents[Path("ch09") / "simulation.json"] = synthetic_simulation()
    documents.update({Path("ch07") / f"leak-{lesson}.json": synthetic_leak_report(lesson) for lesson in ("leaky", "fixed")})
    documents.update({Path("streaming") / f"{w}.json": synthetic_streaming_comparison(w) for w in ("mixed", "default")})
    documents.update({Path("ch08") / "prefix-caching" / f"{w}.json": synthetic_prefix_caching_comparison(w)
                      for w in ("shared-prefix", "default", "mixed")})
    paths = []
    for relative, document in documents.items():
        path = Path(directory) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")
        paths.append(path)
    return paths
