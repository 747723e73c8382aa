"""Made-up but schema-valid results: for the report's tests, the notebook's test, and trying the report offline.

Every figure is given by the caller, so a test can compute what the report must say by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.results import (
    BenchmarkResult,
    Environment,
    Latency,
    LevelResult,
    RunConfig,
    ServerRun,
    save_result,
)


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
