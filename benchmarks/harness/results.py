"""What one benchmark run writes: the schema of the results JSON and where it lives.

How a level's raw records become these figures: :mod:`benchmarks.harness.summaries`.

One JSON per chapter (or labelled variant) and workload:
``benchmarks/results/<profile>/<label>[-<workload>].json`` (``-<workload>`` only for non-default workloads).
The pydantic models below are the schema: :func:`save_result` validates before writing, and
:func:`load_result` validates on reading, so a report never plots a malformed file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.paths import REPO_ROOT

# Version 2 is version 1 plus optional fields: per-level stage timings, a sample of requests, the server's
# batch sizes and figures over time, resource samples over time, the machine's calibration; and the
# open-loop sweep's own file (:class:`OpenLoopResult`). Both versions are read.
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
# A level keeps at most this many requests' own figures (for plots); its summaries use every request.
MAX_REQUEST_SAMPLES = 300
# A level's time series keep at most this many points (downsampled evenly).
MAX_SERIES_POINTS = 60
RESULTS_ROOT = REPO_ROOT / "benchmarks" / "results"
REFERENCE_ROOT = REPO_ROOT / "benchmarks" / "reference"
# A study keeps its results beside its script (benchmarks/studies/<study>/), not under a profile.
STUDIES_ROOT = REPO_ROOT / "benchmarks" / "studies"


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


class LoadGenerator(_Strict):
    """How Locust ran; a results file without it ran one Locust process."""

    workers: int = Field(0, ge=0, description="0: one Locust process; N >= 1: Locust's distributed mode, a master "
                                              "and N worker processes on loopback, their requests merged")


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
    load_generator: LoadGenerator = Field(default_factory=LoadGenerator, description="how Locust ran (absent: one process)")


class Latency(_Strict):
    """Milliseconds, over the successful requests finished inside the measurement window."""

    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    mean: float


class StageSummary(_Strict):
    """One stage of the server's own ``timings_ms`` (parse, queue, prefill, decode, total, ...), in ms,
    over the successful requests of the level that reported it."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float


class RequestSamples(_Strict):
    """At most ``MAX_REQUEST_SAMPLES`` requests of the level, columns of equal length, for plotting.

    Chosen evenly by finishing order among the successful requests the latency figures cover.
    ``stages_ms[name][i]`` is ``None`` where request ``i`` did not report that stage.
    """

    finished_s: list[float] = Field(description="finish time, seconds from the window's start")
    latency_ms: list[float] = Field(description="the time the client saw")
    prompt_tokens: list[int | None]
    stages_ms: dict[str, list[float | None]] = Field(description="the server's timings_ms, per stage")


class ServerSeries(_Strict):
    """What the server said about itself (``/stats``, else ``/healthz``'s ``batcher``) during the level.

    ``batch_sizes`` and ``batches``/``requests`` are deltas over the level (cumulative counters read
    just before Locust started and just after it stopped: the whole level, ramp-up included).
    ``points`` are polls every ``interval_s``: ``t_s`` (seconds from the window's start) and every
    numeric figure of the answer that changed during the level, flattened with dots
    (``pool.blocks_used``), counters as read; the figures that never changed are in ``constants``.
    ``steps``: a step-level scheduler's last steps as the server kept them at the level's end (chapter
    8's ``/stats`` ``steps.recent``: tokens, decode rows, prefill tokens, milliseconds per phase).
    """

    source: Literal["stats", "healthz"]
    interval_s: float
    batch_sizes: dict[str, int] = Field(default_factory=dict, description="batch size -> batches of it, this level")
    batches: int | None = None
    requests: int | None = None
    points: list[dict[str, float]] = Field(default_factory=list)
    constants: dict[str, float] = Field(default_factory=dict)
    steps: list[dict[str, float]] = Field(default_factory=list)


class ResourcePoint(_Strict):
    """One downsampled resource sample: rates over the interval since the previous point."""

    t_s: float = Field(description="seconds from the window's start")
    server_cpu_percent: float | None = None
    loadgen_cpu_percent: float | None = None
    server_rss_mb: float | None = None
    gpu_util_percent: float | None = None
    gpu_memory_mb: float | None = None


class LevelMeasurements(_Strict):
    """What a closed-loop level and an open-loop rate both measure."""

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
    # schema 2 (optional)
    stages_ms: dict[str, StageSummary] | None = Field(None, description="the server's timings_ms, per stage")
    samples: RequestSamples | None = None
    server_series: ServerSeries | None = None
    resource_series: list[ResourcePoint] | None = None


class LevelResult(LevelMeasurements):
    """One closed-loop concurrency level."""

    users: int = Field(description="closed-loop users = requests in flight")
    window_s: float = Field(description="steady-state window: from every user's first answer to the stop")
    stopped_by: Literal["request_target", "time_limit"]


class ServerRun(_Strict):
    startup_s: float = Field(description="from launch to the first healthy /healthz")
    warmup_s: float
    exit_code: int | None = Field(description="after SIGTERM; 0 or -15 is a clean stop")
    choices: dict[str, Any] = Field(
        default_factory=dict,
        description="what the server said of itself in /stats at the end of the run: the engine and attention its start-up rules "
                    "chose, its prefix cache's counters (benchmarks.harness.server_stats.server_choices); empty when it says nothing")


class MatmulRate(_Strict):
    """One linear layer's matrix product, timed on one thread: ``rows x in_features @ in_features x out_features``."""

    name: str
    rows: int
    in_features: int
    out_features: int
    fp32_gflops: float | None
    bf16_gflops: float | None


class Calibration(_Strict):
    """How fast this machine is, apart from any server: tells a slower machine from a slower server.

    ``fp32_gflops`` / ``bf16_gflops``: one thread, the model's linear shapes, total FLOPs over total
    time, keyed by the number of rows (1: one decoding request, 64: a full batch). ``engine_rps``:
    requests per second of chapter 3's batched generation with no server around it, keyed by batch size.
    """

    model: str
    device: str
    torch_threads: int
    fp32_gflops: dict[str, float]
    bf16_gflops: dict[str, float | None]
    bf16_note: str | None = Field(None, description="why bf16 has no figure, or what it ran as")
    matmuls: list[MatmulRate]
    engine_new_tokens: int
    engine_rps: dict[str, float]
    seconds: float = Field(description="how long the calibration took")
    error: str | None = Field(None, description="set when a part could not run; the rest is still valid")


def _check_schema_version(version: int) -> int:
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(f"schema version {version} is not one this code reads ({READABLE_SCHEMA_VERSIONS})")
    return version


class _RunFile(_Strict):
    """What every results file of a run shares: a readable schema version, and its config's workload and profile."""

    @field_validator("schema_version", check_fields=False)
    @classmethod
    def _readable_version(cls, version: int) -> int:
        return _check_schema_version(version)

    @property
    def workload(self) -> str:
        return self.config.workload

    @property
    def profile(self) -> str:
        return self.config.profile


class BenchmarkResult(_RunFile):
    schema_version: int = SCHEMA_VERSION
    chapter: str = Field(description="chapter id (ch02), or 'ceiling' for the harness's own ceiling")
    label: str = Field(description="the chapter id, or the name of a variant (ch01-workers)")
    started_at: str
    finished_at: str
    environment: Environment
    config: RunConfig
    server: ServerRun
    levels: list[LevelResult]
    calibration: Calibration | None = Field(None, description="schema 2: the machine's speed apart from the server")


    def saturation(self) -> LevelResult | None:
        """The level with the highest successful QPS: the chapter's throughput figure."""
        return max(self.levels, key=lambda level: level.qps, default=None)

    def level(self, users: int) -> LevelResult | None:
        return next((level for level in self.levels if level.users == users), None)


# --------------------------------------------------------------------------------------------
# The open-loop sweep: arrivals at a fixed offered rate, independent of the answers.
# --------------------------------------------------------------------------------------------


class OpenLoopConfig(_Strict):
    profile: str
    workload: str
    max_new_tokens: int
    prompt_lengths: list[int]
    seed: int
    rates: list[float] = Field(description="the ladder of offered rates (requests/s), swept upward")
    lead_in_s: float = Field(description="arrivals in the first seconds of a rate are sent but not measured")
    min_level_s: float
    max_level_s: float
    target_requests: int = Field(description="a rate's measured window lasts target/rate seconds, within [min, max]")
    drain_s: float = Field(description="after the last arrival, answers are awaited this long; later ones fail")
    max_outstanding: int = Field(description="arrivals beyond this many requests in flight are dropped (failures)")
    slo_ms: float = Field(description="goodput counts successful requests answered within this")
    stop_p99_ms: float = Field(description="the sweep of a chapter stops after a rate whose P99 exceeds this")
    stop_error_share: float = Field(description="... or whose failed share of arrivals exceeds this")
    server_args: list[str]
    server_command: list[str]
    reproduce: str
    load_generator: LoadGenerator = Field(default_factory=LoadGenerator, description="how Locust ran (absent: one process)")


class OpenLoopLevel(LevelMeasurements):
    """One offered rate. The measured requests are those that *arrived* inside the window (latency,
    failures, goodput); ``qps`` (the achieved rate) is the successful answers that *finished* inside
    the window per second: what the server delivered while that load was offered."""

    offered_rps: float
    window_s: float = Field(description="the measured arrival window (after the lead-in)")
    arrivals: int = Field(description="arrivals inside the window, dropped ones included")
    arrival_rps: float = Field(description="arrivals / window: the offered rate as it came out of the Poisson draw")
    dropped: int = Field(description="arrivals refused because max_outstanding requests were in flight")
    unfinished: int = Field(description="requests still unanswered when the drain ended")
    goodput_rps: float = Field(description="successful requests answered within the SLO, per second of the window")
    max_outstanding_seen: int = Field(description="the most requests in flight at once")

    @property
    def achieved_rps(self) -> float:
        return self.qps

    @property
    def error_share(self) -> float:
        return self.requests_failed / self.arrivals if self.arrivals else 0.0


class OpenLoopResult(_RunFile):
    schema_version: int = SCHEMA_VERSION
    kind: Literal["open_loop"] = "open_loop"
    chapter: str
    label: str
    started_at: str
    finished_at: str
    environment: Environment
    config: OpenLoopConfig
    server: ServerRun
    levels: list[OpenLoopLevel]
    stopped: str | None = Field(None, description="why the sweep stopped (the last rate broke a bound); None: the ladder's end")
    calibration: Calibration | None = None



OPEN_LOOP_DIR = "openloop"


def result_filename(label: str, workload: str) -> str:
    return f"{label}.json" if workload == "default" else f"{label}-{workload}.json"


def save_result(result: BenchmarkResult | OpenLoopResult, directory: Path) -> Path:
    """Validate and write ``result`` under ``directory`` (an open-loop sweep under ``directory/openloop/``);
    returns the file's path."""
    type(result).model_validate(result.model_dump())  # re-validate: fields may have been mutated after construction
    if isinstance(result, OpenLoopResult):
        directory = Path(directory) / OPEN_LOOP_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / result_filename(result.label, result.workload)
    path.write_text(dumps_compact(result.model_dump(mode="json")) + "\n")
    return path


def print_and_save(document: dict, out: Path | None) -> None:
    """A side measurement's JSON (not a :class:`BenchmarkResult`): printed, and written to ``out`` where given."""
    text = json.dumps(document, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def dumps_compact(value: object, indent: int = 2, level: int = 0) -> str:
    """JSON indented like ``indent=2``, except that a list or object whose items are all scalars stays on
    one line: a level's 300-request columns and its series then cost a line each, not a line per number."""
    if _is_scalar(value) or (isinstance(value, (list, dict)) and not value):
        return json.dumps(value)
    items = value.values() if isinstance(value, dict) else value
    if all(_is_scalar(item) for item in items):
        return json.dumps(value, separators=(", ", ": ") if isinstance(value, dict) else (",", ":"))
    pad, inner = " " * indent * level, " " * indent * (level + 1)
    if isinstance(value, dict):
        body = ",\n".join(f"{inner}{json.dumps(k)}: {dumps_compact(v, indent, level + 1)}" for k, v in value.items())
        return "{\n" + body + "\n" + pad + "}"
    body = ",\n".join(f"{inner}{dumps_compact(v, indent, level + 1)}" for v in value)
    return "[\n" + body + "\n" + pad + "]"


def load_result(path: Path) -> BenchmarkResult:
    return BenchmarkResult.model_validate_json(Path(path).read_text())


def load_open_loop_result(path: Path) -> OpenLoopResult:
    return OpenLoopResult.model_validate_json(Path(path).read_text())


def load_open_loop_results(directory: Path, workload: str = "default") -> dict[str, OpenLoopResult]:
    """Every open-loop sweep of ``workload`` in ``directory/openloop/``, keyed by label; {} when there is none."""
    results = {}
    for path in sorted((Path(directory) / OPEN_LOOP_DIR).glob("*.json")):
        try:
            result = load_open_loop_result(path)
        except ValueError:
            continue
        if result.workload == workload:
            results[result.label] = result
    return results


def find_calibration(results) -> Calibration | None:
    """The first calibration among ``results`` (any iterable of results), or None."""
    return next((r.calibration for r in results if getattr(r, "calibration", None) is not None), None)


def load_results(directory: Path, workload: str = "default") -> dict[str, BenchmarkResult]:
    """Every chapter result of ``workload`` in ``directory``, keyed by label (the ceiling excluded)."""
    results = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            result = load_result(path)
        except ValueError:
            continue  # not one of ours (or a schema version not read here): the report says nothing about it
        if result.chapter != "ceiling" and result.workload == workload:
            results[result.label] = result
    return results


def load_ceiling(directory: Path) -> BenchmarkResult | None:
    path = Path(directory) / "ceiling.json"
    return load_result(path) if path.exists() else None
