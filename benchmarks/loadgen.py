"""Run one load level, closed loop (a number of users) or open loop (an offered rate): Locust headless as a
subprocess, its records turned into the level's figures, with the server's own figures polled beside it.

Locust is only ever started through its command line (``python -m locust``), never imported here:
importing it monkey-patches sockets and threads with gevent, which would change how the harness
itself (its sampler thread, its HTTP client) behaves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results import (
    MAX_SERIES_POINTS,
    REPO_ROOT,
    LevelResult,
    OpenLoopLevel,
    ResourcePoint,
    evenly_chosen,
    summarize_level,
    summarize_open_level,
)
from benchmarks.sampling import ResourceSampler
from benchmarks.server_process import pin_to_cores
from benchmarks.server_stats import Source, StatsPoller
from benchmarks.workload import Workload

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# The locustfile times the steady-state window itself; Locust's -t is only the outer bound, which must
# also cover starting the users (about a second: -r = -u) and their first round (every user's first
# answer; a slow server at 64 users takes seconds).
FIRST_ROUND_ALLOWANCE_S = 60.0
PROCESS_GRACE_S = 60.0  # Python + gevent start-up and shutdown around the run itself


@dataclass(frozen=True)
class LevelPlan:
    """What one Locust run does; the harness builds it from the profile."""

    users: int
    min_s: float
    max_s: float
    target_requests: int
    workload: Workload
    seed: int
    vocab_size: int
    request_timeout_s: float


@dataclass(frozen=True)
class OpenLevelPlan:
    """One offered rate of the open loop: arrivals for ``lead_in_s + window_s``, then a drain."""

    rate: float  # offered requests per second
    lead_in_s: float  # arrivals sent but not measured: the server leaves its idle state
    window_s: float  # arrivals measured
    drain_s: float
    max_outstanding: int
    slo_ms: float
    workload: Workload
    seed: int
    vocab_size: int
    request_timeout_s: float


def locust_command(url: str, plan: LevelPlan, csv_prefix: Path) -> list[str]:
    run_time_s = int(round(plan.max_s + FIRST_ROUND_ALLOWANCE_S))
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(plan.users), "-r", str(plan.users), "-t", f"{run_time_s}s",
        "--host", url, "--csv", str(csv_prefix), "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0", "InferenceUser",
    ]


def open_locust_command(url: str, plan: OpenLevelPlan, csv_prefix: Path) -> list[str]:
    """One ``OpenLoopUser``: the arrival clock. ``-t`` only bounds the run; the user quits after its drain."""
    run_time_s = int(round(plan.lead_in_s + plan.window_s + plan.drain_s + PROCESS_GRACE_S))
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", "1", "-r", "1", "-t", f"{run_time_s}s",
        "--host", url, "--csv", str(csv_prefix), "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0", "OpenLoopUser",
    ]


def _base_env(workload: Workload, seed: int, vocab_size: int, request_timeout_s: float, records_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "SFS_BENCH_WORKLOAD": workload.name,
        "SFS_BENCH_SEED": str(seed),
        "SFS_BENCH_VOCAB_SIZE": str(vocab_size),
        "SFS_BENCH_TIMEOUT_S": str(request_timeout_s),
        "SFS_BENCH_RECORDS": str(records_path),
    }


def locust_env(plan: LevelPlan, records_path: Path) -> dict[str, str]:
    return {
        **_base_env(plan.workload, plan.seed, plan.vocab_size, plan.request_timeout_s, records_path),
        "SFS_BENCH_TARGET_REQUESTS": str(plan.target_requests),
        "SFS_BENCH_MIN_SECONDS": str(plan.min_s),
        "SFS_BENCH_MAX_SECONDS": str(plan.max_s),
    }


def open_locust_env(plan: OpenLevelPlan, records_path: Path) -> dict[str, str]:
    return {
        **_base_env(plan.workload, plan.seed, plan.vocab_size, plan.request_timeout_s, records_path),
        "SFS_BENCH_OPEN_RATE": str(plan.rate),
        "SFS_BENCH_OPEN_SECONDS": str(plan.lead_in_s + plan.window_s),
        "SFS_BENCH_MAX_OUTSTANDING": str(plan.max_outstanding),
        "SFS_BENCH_DRAIN_S": str(plan.drain_s),
    }


def resource_series(sampler: ResourceSampler, window_start: float, max_points: int = MAX_SERIES_POINTS) -> list[ResourcePoint]:
    """The sampler's samples, evenly thinned to ``max_points``, as rates over each step (CPU) and levels (memory)."""
    chosen = evenly_chosen(sampler.samples, max_points + 1)
    points = []
    for previous, sample in zip(chosen, chosen[1:]):
        elapsed = sample.at - previous.at

        def cpu(name: str) -> float | None:
            if elapsed <= 0 or name not in sample.cpu_s or name not in previous.cpu_s:
                return None
            used = sample.cpu_s[name] - previous.cpu_s[name]
            return round(100.0 * used / elapsed, 1) if used >= 0 else None

        rss = sample.rss_bytes.get("server")
        points.append(ResourcePoint(
            t_s=round(sample.at - window_start, 3),
            server_cpu_percent=cpu("server"), loadgen_cpu_percent=cpu("loadgen"),
            server_rss_mb=None if rss is None else round(rss / 2**20, 1),
            gpu_util_percent=sample.gpu_util_percent,
            gpu_memory_mb=None if sample.gpu_memory_bytes is None else round(sample.gpu_memory_bytes / 2**20, 1),
        ))
    return points


def _run_locust(
    command: list[str], env: dict[str, str], *, server_pid: int, loadgen_cores: list[int] | None,
    log_path: Path, records_path: Path, timeout_s: float, what: str, poller: StatsPoller | None,
) -> tuple[int, dict, ResourceSampler]:
    """Run one Locust process while sampling resources (and polling the server's figures); returns its
    exit code, its records and the sampler."""
    records_path.unlink(missing_ok=True)
    if poller is not None:
        poller.start()
    try:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=pin_to_cores(loadgen_cores),
            )
            sampler = ResourceSampler({"server": server_pid, "loadgen": process.pid}).start()
            try:
                exit_code = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"Locust did not finish {what}; log: {log_path}") from None
            finally:
                if process.poll() is None:  # timed out, or the harness itself was interrupted: leave nothing behind
                    process.kill()
                    process.wait()
                sampler.stop()
    finally:
        if poller is not None:
            poller.stop()
    if not records_path.exists():
        raise RuntimeError(f"Locust wrote no records (exit {exit_code}):\n{log_path.read_text(errors='replace')[-3000:]}")
    return exit_code, json.loads(records_path.read_text()), sampler


def run_level(
    url: str, plan: LevelPlan, *, server_pid: int, loadgen_cores: list[int] | None, work_dir: Path,
    stats_source: Source | None = None,
) -> LevelResult:
    """Run Locust at ``plan.users`` against ``url`` and summarise it; the server must already be warm.

    ``stats_source``: where the server reports its batcher (:func:`benchmarks.server_stats.detect_source`);
    ``None`` records no server figures. Locust's CSV files and log stay in ``work_dir`` (``level-<users>*``).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = work_dir / f"level-{plan.users}"
    records_path = stem.with_suffix(".records.json")
    log_path = stem.with_suffix(".locust.log")
    poller = StatsPoller(url, stats_source) if stats_source is not None else None
    exit_code, run, sampler = _run_locust(
        locust_command(url, plan, stem), locust_env(plan, records_path), server_pid=server_pid,
        loadgen_cores=loadgen_cores, log_path=log_path, records_path=records_path,
        timeout_s=plan.max_s + FIRST_ROUND_ALLOWANCE_S + PROCESS_GRACE_S, what=f"the level at {plan.users} users",
        poller=poller,
    )
    records = run["requests"]
    if run["steady_at"] is None:
        raise RuntimeError(
            f"the level at {plan.users} users never reached a steady state (not every user got a first answer "
            f"within {FIRST_ROUND_ALLOWANCE_S:.0f} s); log: {log_path}"
        )
    window_start = run["steady_at"]
    window_end = run["stopping_at"] or max((r[0] + r[1] for r in records), default=window_start)
    return summarize_level(
        records, window_start, window_end,
        users=plan.users, stopped_by=run["stopped_by"], locust_exit_code=exit_code,
        resources=sampler.summary(window_start, window_end),
        extras=_series(sampler, poller, window_start),
    )


def _series(sampler: ResourceSampler, poller: StatsPoller | None, window_start: float) -> dict:
    return {
        "resource_series": resource_series(sampler, window_start),
        "server_series": poller.series(window_start) if poller is not None else None,
    }


def run_open_level(
    url: str, plan: OpenLevelPlan, *, server_pid: int, loadgen_cores: list[int] | None, work_dir: Path,
    stats_source: Source | None = None,
) -> OpenLoopLevel:
    """Offer ``plan.rate`` requests/s to ``url`` (Poisson arrivals) and summarise the measured window."""
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = work_dir / f"rate-{plan.rate:g}"
    records_path = stem.with_suffix(".records.json")
    log_path = stem.with_suffix(".locust.log")
    poller = StatsPoller(url, stats_source) if stats_source is not None else None
    exit_code, run, sampler = _run_locust(
        open_locust_command(url, plan, stem), open_locust_env(plan, records_path), server_pid=server_pid,
        loadgen_cores=loadgen_cores, log_path=log_path, records_path=records_path,
        timeout_s=plan.lead_in_s + plan.window_s + plan.drain_s + 2 * PROCESS_GRACE_S, what=f"the rate {plan.rate:g}/s",
        poller=poller,
    )
    if run.get("first_arrival_at") is None:
        raise RuntimeError(f"the open loop at {plan.rate:g}/s sent nothing; log: {log_path}")
    window_start = run["first_arrival_at"] + plan.lead_in_s
    window_end = window_start + plan.window_s
    return summarize_open_level(
        run["requests"], window_start, window_end,
        offered_rps=plan.rate, dropped_at=run["dropped_at"], unfinished_at=run["unfinished_at"],
        max_outstanding_seen=run["max_outstanding_seen"], slo_ms=plan.slo_ms, locust_exit_code=exit_code,
        resources=sampler.summary(window_start, window_end),
        extras=_series(sampler, poller, window_start),
    )
