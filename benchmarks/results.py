"""What one benchmark run writes: the schema of the results JSON, where it lives, and how a level is summarised.

One JSON per chapter (or labelled variant) and workload:
``benchmarks/results/<profile>/<label>[-<workload>].json`` (``-<workload>`` only for non-default workloads).
The pydantic models below are the schema: :func:`save_result` validates before writing, and
:func:`load_result` validates on reading, so a report never plots a malformed file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = REPO_ROOT / "benchmarks" / "results"
REFERENCE_ROOT = REPO_ROOT / "benchmarks" / "reference"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Environment(_Strict):
    """Where and how it ran: enough to judge whether two results are comparable."""

    git_commit: str | None
    git_dirty: bool | None
    python: str
    torch: str | None
    locust: str | None
    platform: str
    cpu_model: str
    logical_cores: int
    physical_cores: int | None
    gpu: str | None
    cuda: str | None
    load_average_at_start: list[float] | None = Field(description="1/5/15-minute load: a busy machine skews every figure")
    torch_threads: int = Field(description="--torch-threads given to every server")
    thread_env: dict[str, str] = Field(description="environment given to every server: OMP/MKL/OpenBLAS thread variables and the profile's SFS_* settings")
    pinning: bool = Field(description="server and load generator pinned to separate cores")
    server_cores: list[int] | None
    loadgen_cores: list[int] | None


class RunConfig(_Strict):
    profile: str
    workload: str
    max_new_tokens: int
    prompt_lengths: list[int]
    seed: int
    closed_loop: bool = Field(True, description="each user sends its next request as soon as the answer arrives")
    levels: list[int] = Field(description="concurrency levels = simultaneous users = requests in flight")
    min_level_s: float
    max_level_s: float
    target_requests: int = Field(description="a level stops early once this many successes were measured")
    warmup_requests: int
    server_args: list[str]
    server_command: list[str]
    reproduce: str = Field(description="the harness command that reproduces this file")


class Latency(_Strict):
    """Milliseconds, over the successful requests finished inside the measurement window."""

    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    mean: float


class LevelResult(_Strict):
    users: int = Field(description="closed-loop users = requests in flight")
    window_s: float = Field(description="steady-state window: from every user's first answer to the stop")
    stopped_by: Literal["request_target", "time_limit"]
    requests_ok: int = Field(description="successful requests finished inside the window")
    requests_failed: int = Field(description="failed requests finished inside the window")
    latency_sample: int = Field(description="successful requests whose latencies the percentiles are taken over")
    qps: float = Field(description="successful requests finished per second of the window")
    tokens_per_s: float = Field(description="generated tokens of successful requests per second of the window")
    latency_ms: Latency | None
    errors_by_status: dict[str, int] = Field(description="failures by HTTP status; '0' = no HTTP answer")
    failure_reasons: dict[str, int] = Field(description="the most frequent failure messages")
    loadgen_cpu_percent: float | None = Field(None, description="load generator CPU, % of one core (100 = one core busy)")
    loadgen_cpu_wait_percent: float | None = Field(
        None, description="load generator runnable but waiting for a CPU, % of one core (Linux): it was starved"
    )
    server_cpu_percent: float | None = Field(None, description="server process tree CPU, % of one core")
    server_cpu_wait_percent: float | None = Field(
        None, description="server threads runnable but waiting for a CPU, % of one core (Linux): others competed"
    )
    server_rss_mb_max: float | None = None
    server_rss_mb_mean: float | None = None
    gpu_util_percent_mean: float | None = None
    gpu_memory_mb_max: float | None = None
    locust_exit_code: int


class ServerRun(_Strict):
    startup_s: float = Field(description="from launch to the first healthy /healthz")
    warmup_s: float
    exit_code: int | None = Field(description="after SIGTERM; 0 or -15 is a clean stop")


class BenchmarkResult(_Strict):
    schema_version: int = SCHEMA_VERSION
    chapter: str = Field(description="chapter id (ch02), or 'ceiling' for the harness's own ceiling")
    label: str = Field(description="the chapter id, or the name of a variant (ch01-workers)")
    started_at: str
    finished_at: str
    environment: Environment
    config: RunConfig
    server: ServerRun
    levels: list[LevelResult]

    @property
    def workload(self) -> str:
        return self.config.workload

    @property
    def profile(self) -> str:
        return self.config.profile

    def saturation(self) -> LevelResult | None:
        """The level with the highest successful QPS: the chapter's throughput figure."""
        return max(self.levels, key=lambda level: level.qps, default=None)


def result_filename(label: str, workload: str) -> str:
    return f"{label}.json" if workload == "default" else f"{label}-{workload}.json"


def save_result(result: BenchmarkResult, directory: Path) -> Path:
    """Validate and write ``result`` under ``directory``; returns the file's path."""
    BenchmarkResult.model_validate(result.model_dump())  # re-validate: fields may have been mutated after construction
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / result_filename(result.label, result.workload)
    path.write_text(result.model_dump_json(indent=2) + "\n")
    return path


def load_result(path: Path) -> BenchmarkResult:
    return BenchmarkResult.model_validate_json(Path(path).read_text())


def load_results(directory: Path, workload: str = "default") -> dict[str, BenchmarkResult]:
    """Every chapter result of ``workload`` in ``directory``, keyed by label (the ceiling excluded)."""
    results = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            result = load_result(path)
        except ValueError:
            continue  # not one of ours (or an older schema): the report says nothing about it
        if result.chapter != "ceiling" and result.workload == workload:
            results[result.label] = result
    return results


def load_ceiling(directory: Path) -> BenchmarkResult | None:
    path = Path(directory) / "ceiling.json"
    return load_result(path) if path.exists() else None


# --------------------------------------------------------------------------------------------
# From one Locust level's per-request records to the level's figures.
# --------------------------------------------------------------------------------------------

MAX_FAILURE_REASONS = 5


def percentile_ms(latencies_s: list[float], q: float) -> float:
    """The ``q``-th percentile in ms, linear interpolation between order statistics (numpy's default)."""
    return float(np.percentile(np.asarray(latencies_s) * 1e3, q))


def summarize_level(
    records: list[list],
    window_start: float,
    window_end: float,
    *,
    users: int,
    stopped_by: Literal["request_target", "time_limit"],
    locust_exit_code: int,
    resources: dict[str, float | None] | None = None,
) -> LevelResult:
    """The level's figures from Locust's records ``[start, latency_s, status, ok, tokens, reason]``.

    Contract:
    - the window opens once every user has had its first answer (the locustfile's steady state), so
      the first round of requests, sent all at once and queued behind fewer others, is left out;
    - throughput counts requests *finished* inside ``[window_start, window_end]``: every user is busy
      throughout, so completions per second are the server's rate at ``users``;
    - latency percentiles are taken over the same successful requests (every one a second-round or
      later request, since the first round has finished when the window opens);
    - failures are counted by status, ``0`` meaning no HTTP answer at all.
    """
    window_s = max(window_end - window_start, 1e-9)
    finished = [r for r in records if window_start <= r[0] + r[1] <= window_end]
    ok = [r for r in finished if r[3]]
    failed = [r for r in finished if not r[3]]
    latencies = [r[1] for r in ok]
    latency = None
    if latencies:
        latency = Latency(
            p50=percentile_ms(latencies, 50), p90=percentile_ms(latencies, 90), p95=percentile_ms(latencies, 95),
            p99=percentile_ms(latencies, 99), max=max(latencies) * 1e3, mean=float(np.mean(latencies)) * 1e3,
        )
    resources = resources or {}
    return LevelResult(
        users=users,
        window_s=window_s,
        stopped_by=stopped_by,
        requests_ok=len(ok),
        requests_failed=len(failed),
        latency_sample=len(latencies),
        qps=len(ok) / window_s,
        tokens_per_s=sum(r[4] for r in ok) / window_s,
        latency_ms=latency,
        errors_by_status=dict(sorted(Counter(str(r[2]) for r in failed).items())),
        failure_reasons=dict(Counter(str(r[5]) for r in failed).most_common(MAX_FAILURE_REASONS)),
        locust_exit_code=locust_exit_code,
        **resources,
    )
