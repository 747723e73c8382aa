"""Run one load level, closed loop (a number of users) or open loop (an offered rate): Locust headless as a
subprocess, its records turned into the level's figures, with the server's own figures polled beside it.

Locust is only ever started through its command line (``python -m locust``), never imported here:
importing it monkey-patches sockets and threads with gevent, which would change how the harness
itself (its sampler thread, its HTTP client) behaves.

One process by default (``workers=0``). With ``workers=N >= 1`` a level runs in Locust's distributed
mode on this machine: a master bound to loopback only and N worker processes connected to it. Each
process writes its own records; :func:`merge_runs` turns them into the one run a single process
would have written, so a level's figures are computed the same way in both modes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.resource_sampler import ResourceSampler
from benchmarks.harness.results import MAX_SERIES_POINTS, REPO_ROOT, LevelResult, OpenLoopLevel, ResourcePoint
from benchmarks.harness.server_process import free_port, pin_to_cores
from benchmarks.harness.server_stats import Source, StatsPoller
from benchmarks.harness.summaries import evenly_chosen, summarize_level, summarize_open_level
from benchmarks.harness.workload import Workload

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# The locustfile times the steady-state window itself; Locust's -t is only the outer bound, which must
# also cover starting the users (-r = -u: all in the first second) and their first round (every user's
# first answer).
FIRST_ROUND_ALLOWANCE_S = 60.0
PROCESS_GRACE_S = 60.0  # Python + gevent start-up and shutdown around the run itself
# Distributed mode. The master gives up (and exits non-zero) when its workers have not all connected by
# then, rather than wait forever (Locust's default); the harness's own bound on the run includes it.
EXPECT_WORKERS_MAX_WAIT_S = 30
# Workers exit on the master's quit message; past this after the master, they are killed.
WORKER_EXIT_GRACE_S = 15.0
GROUP_POLL_S = 0.1  # how often the harness looks at its Locust processes (several children: nothing to await)
LOOPBACK = "127.0.0.1"


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
    workers: int = 0  # 0: one Locust process; N >= 1: a master and N worker processes sharing the users
    first_round_s: float = FIRST_ROUND_ALLOWANCE_S  # every user's first answer within this, or the level fails


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
    workers: int = 0  # 0: one Locust process; N >= 1: a master and N workers, each at rate / N


@dataclass(frozen=True)
class Distribution:
    """Locust's distributed mode on this machine: a master listening on ``LOOPBACK:port`` only, ``workers`` workers."""

    workers: int
    port: int


def distribution_for(workers: int) -> Distribution | None:
    """``None`` for ``workers=0`` (one process); else a master on a free loopback port for ``workers`` workers."""
    if workers < 0:
        raise ValueError(f"workers must be 0 (one Locust process) or more, got {workers}")
    return Distribution(workers, free_port()) if workers else None


def _master_flags(distribution: Distribution | None) -> list[str]:
    if distribution is None:
        return []
    return [
        "--master", "--master-bind-host", LOOPBACK, "--master-bind-port", str(distribution.port),
        "--expect-workers", str(distribution.workers), "--expect-workers-max-wait", str(EXPECT_WORKERS_MAX_WAIT_S),
    ]


def locust_command(url: str, plan: LevelPlan, csv_prefix: Path, distribution: Distribution | None = None) -> list[str]:
    """The single process's command, or with ``distribution`` the master's (which then runs no users itself)."""
    run_time_s = int(round(plan.max_s + plan.first_round_s))
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(plan.users), "-r", str(plan.users), "-t", f"{run_time_s}s",
        "--host", url, "--csv", str(csv_prefix), "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0", *_master_flags(distribution), "InferenceUser",
    ]


def open_locust_command(
    url: str, plan: OpenLevelPlan, csv_prefix: Path, distribution: Distribution | None = None
) -> list[str]:
    """One ``OpenLoopUser`` per process that runs users: the arrival clock (with ``distribution``, one on each
    worker). ``-t`` only bounds the run; the users end it after their drain."""
    run_time_s = int(round(plan.lead_in_s + plan.window_s + plan.drain_s + PROCESS_GRACE_S))
    clocks = str(distribution.workers if distribution else 1)
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", clocks, "-r", clocks, "-t", f"{run_time_s}s",
        "--host", url, "--csv", str(csv_prefix), "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0", *_master_flags(distribution), "OpenLoopUser",
    ]


def worker_command(user_class: str, distribution: Distribution) -> list[str]:
    """A worker: it connects to the master on loopback and runs the users the master gives it."""
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker",
        "--master-host", LOOPBACK, "--master-port", str(distribution.port),
        "--loglevel", "WARNING", "--exit-code-on-error", "0", user_class,
    ]


def open_plan_per_worker(plan: OpenLevelPlan, workers: int) -> OpenLevelPlan:
    """What one of ``workers`` open-loop workers offers: the rate divided (their arrival streams add up to
    ``plan.rate``) and the in-flight cap divided (their caps add up to at most ``plan.max_outstanding``)."""
    if workers < 1:
        return plan
    return dataclasses.replace(
        plan, rate=plan.rate / workers, max_outstanding=max(1, plan.max_outstanding // workers), workers=0
    )


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


def _distributed_env(workers: int, worker_index: int | None = None) -> dict[str, str]:
    env = {"SFS_BENCH_WORKERS": str(workers)}
    if worker_index is not None:
        env["SFS_BENCH_WORKER_INDEX"] = str(worker_index)
    return env


@dataclass(frozen=True)
class LocustProcess:
    """One process of a Locust run: the single process, the master, or worker ``worker_index``."""

    role: str  # "single", "master", "worker"
    command: list[str]
    env: dict[str, str]
    log_path: Path
    records_path: Path
    worker_index: int | None = None

    @property
    def name(self) -> str:
        """For messages: ``Locust process``, ``Locust master``, ``Locust worker 1``."""
        return {"single": "process", "worker": f"worker {self.worker_index}"}.get(self.role, self.role)


def _next_to(stem: Path, suffix: str) -> Path:
    return stem.with_name(stem.name + suffix)


def _assemble(
    stem: Path, distribution: Distribution | None, lead_command: list[str], lead_env: dict[str, str],
    worker_user_class: str, worker_env: Callable[[Path], dict[str, str]],
) -> list[LocustProcess]:
    """The lead process (the single one, or the master) first, then the workers: each its own log and records."""
    lead_records = _next_to(stem, ".records.json")
    if distribution is None:
        return [LocustProcess("single", lead_command, lead_env, _next_to(stem, ".locust.log"), lead_records)]
    processes = [LocustProcess(
        "master", lead_command, {**lead_env, **_distributed_env(distribution.workers)},
        _next_to(stem, ".locust.log"), lead_records,
    )]
    for index in range(distribution.workers):
        records = _next_to(stem, f".worker{index}.records.json")
        processes.append(LocustProcess(
            "worker", worker_command(worker_user_class, distribution),
            {**worker_env(records), **_distributed_env(distribution.workers, index)},
            _next_to(stem, f".worker{index}.locust.log"), records, worker_index=index,
        ))
    return processes


def locust_processes(url: str, plan: LevelPlan, stem: Path) -> list[LocustProcess]:
    """The processes of a closed-loop level, lead first; Locust's CSV files, logs and records are named after ``stem``."""
    distribution = distribution_for(plan.workers)
    lead_records = _next_to(stem, ".records.json")
    return _assemble(
        stem, distribution, locust_command(url, plan, stem, distribution), locust_env(plan, lead_records),
        "InferenceUser", lambda records: locust_env(plan, records),
    )


def open_locust_processes(url: str, plan: OpenLevelPlan, stem: Path) -> list[LocustProcess]:
    """The processes of one offered rate, lead first; each worker offers its share (:func:`open_plan_per_worker`)."""
    distribution = distribution_for(plan.workers)
    lead_records = _next_to(stem, ".records.json")
    share = open_plan_per_worker(plan, plan.workers)
    return _assemble(
        stem, distribution, open_locust_command(url, plan, stem, distribution), open_locust_env(plan, lead_records),
        "OpenLoopUser", lambda records: open_locust_env(share, records),
    )


# ---------------------------------------------------------------- merging a distributed run's records


def max_in_flight(records: Sequence[list], unfinished_at: Sequence[float]) -> int:
    """The most requests in flight at once: each record from its start to its answer, an unanswered arrival
    from its arrival on. A distributed open loop's figure, over all its workers together."""
    events = [(r[0], 1) for r in records] + [(r[0] + r[1], -1) for r in records] + [(t, 1) for t in unfinished_at]
    most = current = 0
    for _, step in sorted(events):  # at equal times an answer (-1) is counted before an arrival (+1)
        current += step
        most = max(most, current)
    return most


def merge_runs(master: dict, workers: Sequence[dict]) -> dict:
    """The records of a distributed run, as one process would have written them.

    Contract: the window and the stop (``steady_at``, ``stopping_at``, ``stopped_by``) are the master's,
    which decided them over every worker; the requests, dropped and unanswered arrivals are every
    worker's, in order of start; the open loop's first arrival is the earliest (the workers share one
    start time) and its most-in-flight is counted over all workers' requests (:func:`max_in_flight`).
    ``requests_per_worker`` says what each worker contributed. Raises when a worker's records show that
    it did not run to the end of the level: its requests would be missing from part of the window.
    """
    for run in workers:
        index = run.get("worker_index")
        if run.get("open_rate"):
            if not run.get("open_loop_done"):
                raise RuntimeError(f"Locust worker {index} stopped before its open loop was over")
        elif run.get("stopping_at") is None or (
            master.get("stopping_at") is not None and run["stopping_at"] < master["stopping_at"]
        ):
            raise RuntimeError(f"Locust worker {index} stopped before the master ended the level")
    requests = sorted((r for run in workers for r in run["requests"]), key=lambda r: r[0])
    unfinished_at = sorted(t for run in workers for t in run["unfinished_at"])
    first_arrivals = [run["first_arrival_at"] for run in workers if run.get("first_arrival_at") is not None]
    return {
        **master,
        "requests": requests,
        "dropped_at": sorted(t for run in workers for t in run["dropped_at"]),
        "unfinished_at": unfinished_at,
        "first_arrival_at": min(first_arrivals, default=None),
        "max_outstanding_seen": max_in_flight(requests, unfinished_at),
        "requests_per_worker": [len(run["requests"]) for run in workers],
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


def _die_with_parent(pin: Callable[[], None] | None) -> Callable[[], None] | None:
    """A ``preexec_fn``: pin the child (when asked), and on Linux have the kernel kill it if the harness dies
    without cleaning up (SIGKILL, a crash): no Locust process outlives the harness."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def setup() -> None:
        if pin is not None:
            pin()
        if libc is not None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return setup if (pin is not None or libc is not None) else None


def _log_tail(path: Path, n_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-n_chars:] if path.exists() else "(no log)"


def _await_group(started: list[tuple[LocustProcess, subprocess.Popen]], timeout_s: float, what: str) -> int:
    """Wait for the lead process, then for the workers; returns the lead's exit code.

    Raises (the caller kills whatever still runs) when the run passes ``timeout_s``; when a worker exits
    non-zero (it took its users' records with it); when the master exits non-zero while workers still run
    (it gave up waiting for them to connect, or failed); or when workers outlive the master by more than
    ``WORKER_EXIT_GRACE_S``. A worker that exits 0 was stopped by the master.
    """
    (lead_spec, lead), workers = started[0], started[1:]
    deadline = time.monotonic() + timeout_s
    lead_code = None
    while True:
        for spec, process in workers:
            code = process.poll()
            if code not in (None, 0):
                raise RuntimeError(f"Locust {spec.name} exited with {code} during {what}:\n{_log_tail(spec.log_path)}")
        if lead_code is None and (lead_code := lead.poll()) is not None and workers:
            running = [spec.name for spec, process in workers if process.poll() is None]
            if lead_code != 0 and running:
                raise RuntimeError(
                    f"Locust {lead_spec.name} exited with {lead_code} during {what} while {', '.join(running)} still "
                    f"ran:\n{_log_tail(lead_spec.log_path)}"
                )
            deadline = min(deadline, time.monotonic() + WORKER_EXIT_GRACE_S)  # its quit message stops the workers
        if lead_code is not None and all(process.poll() is not None for _, process in workers):
            return lead_code
        if time.monotonic() > deadline:
            late = lead_spec if lead_code is None else next(s for s, p in workers if p.poll() is None)
            raise RuntimeError(f"Locust did not finish {what} ({late.name} still running); log: {late.log_path}")
        time.sleep(GROUP_POLL_S)


def _fold_loadgen_samples(sampler: ResourceSampler, names: Sequence[str]) -> None:
    """Sum the load generator's processes into one ``loadgen`` figure per sample, as the single process's tree
    would be; a sample that missed one of them (it had exited) gets none, rather than a partial sum."""
    for sample in sampler.samples:
        for figures in (sample.cpu_s, sample.wait_s, sample.rss_bytes):
            parts = [figures.pop(name) for name in names if name in figures]
            if len(parts) == len(names):
                figures["loadgen"] = None if any(part is None for part in parts) else sum(parts)


def _run_locust(
    processes: Sequence[LocustProcess], *, server_pid: int, loadgen_cores: list[int] | None,
    timeout_s: float, what: str, poller: StatsPoller | None,
) -> tuple[int, dict, ResourceSampler]:
    """Run a level's Locust processes (one, or a master and its workers) while sampling resources (and
    polling the server's figures); returns the lead's exit code, the run's records (merged over the
    workers) and the sampler. Every process is stopped on every path out: the level's end, a timeout,
    a failing worker, an exception or Ctrl-C in the harness."""
    for spec in processes:
        spec.records_path.unlink(missing_ok=True)
    preexec = _die_with_parent(pin_to_cores(loadgen_cores))
    started: list[tuple[LocustProcess, subprocess.Popen]] = []
    sampler = None
    if poller is not None:
        poller.start()
    try:
        for spec in processes:
            with open(spec.log_path, "wb") as log:
                started.append((spec, subprocess.Popen(
                    spec.command, cwd=REPO_ROOT, env=spec.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec,
                )))
        trees = {"server": server_pid}
        if len(started) == 1:
            trees["loadgen"] = started[0][1].pid
        else:
            trees.update({f"loadgen {spec.name}": process.pid for spec, process in started})
        sampler = ResourceSampler(trees).start()
        exit_code = _await_group(started, timeout_s, what)
    finally:
        for _, process in started:
            if process.poll() is None:  # timed out, a worker failed, or the harness was interrupted: leave nothing behind
                process.kill()
        for _, process in started:
            process.wait()
        if sampler is not None:
            sampler.stop()
        if poller is not None:
            poller.stop()
    if len(started) > 1:
        _fold_loadgen_samples(sampler, [name for name in sampler.roots if name.startswith("loadgen ")])
    runs = []
    for spec in processes:
        if not spec.records_path.exists():
            raise RuntimeError(f"Locust {spec.name} wrote no records (exit {exit_code}):\n{_log_tail(spec.log_path)}")
        runs.append(json.loads(spec.records_path.read_text()))
    return exit_code, (runs[0] if len(runs) == 1 else merge_runs(runs[0], runs[1:])), sampler


def run_level(
    url: str, plan: LevelPlan, *, server_pid: int, loadgen_cores: list[int] | None, work_dir: Path,
    stats_source: Source | None = None,
) -> LevelResult:
    """Run Locust at ``plan.users`` against ``url`` and summarise it; the server must already be warm.

    ``stats_source``: where the server reports its batcher (:func:`benchmarks.harness.server_stats.detect_source`);
    ``None`` records no server figures. Locust's CSV files and log stay in ``work_dir`` (``level-<users>*``).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    processes = locust_processes(url, plan, work_dir / f"level-{plan.users}")
    log_path = processes[0].log_path
    poller = StatsPoller(url, stats_source) if stats_source is not None else None
    exit_code, run, sampler = _run_locust(
        processes, server_pid=server_pid, loadgen_cores=loadgen_cores,
        timeout_s=plan.max_s + plan.first_round_s + PROCESS_GRACE_S + _connect_allowance(plan.workers),
        what=f"the level at {plan.users} users", poller=poller,
    )
    records = run["requests"]
    if run["steady_at"] is None:
        raise RuntimeError(
            f"the level at {plan.users} users never reached a steady state (not every user got a first answer "
            f"within {plan.first_round_s:.0f} s); log: {log_path}"
        )
    window_start = run["steady_at"]
    window_end = run["stopping_at"] or max((r[0] + r[1] for r in records), default=window_start)
    return summarize_level(
        records, window_start, window_end,
        users=plan.users, stopped_by=run["stopped_by"], locust_exit_code=exit_code,
        resources=sampler.summary(window_start, window_end),
        extras=_series(sampler, poller, window_start),
    )


def _connect_allowance(workers: int) -> float:
    """The time a distributed run may spend waiting for its workers to connect, before the level itself starts."""
    return float(EXPECT_WORKERS_MAX_WAIT_S) if workers else 0.0


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
    processes = open_locust_processes(url, plan, work_dir / f"rate-{plan.rate:g}")
    log_path = processes[0].log_path
    poller = StatsPoller(url, stats_source) if stats_source is not None else None
    exit_code, run, sampler = _run_locust(
        processes, server_pid=server_pid, loadgen_cores=loadgen_cores,
        timeout_s=plan.lead_in_s + plan.window_s + plan.drain_s + 2 * PROCESS_GRACE_S + _connect_allowance(plan.workers),
        what=f"the rate {plan.rate:g}/s", poller=poller,
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
