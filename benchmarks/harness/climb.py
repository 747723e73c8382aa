"""Measure a chapter: start its server, warm it up, load it at each level of a profile, write the results.

One chapter (:func:`run_chapter`) or every chapter in order (:func:`climb`). Everything a figure
depends on is set explicitly and recorded: the model flags, the thread count and thread variables,
the cores of the server and of the load generator, the workload and its seed, and how Locust ran (one
process, or ``loadgen_workers`` workers under a master: :mod:`benchmarks.harness.loadgen`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path

import requests

from benchmarks.harness.article import ARTICLE_CHAPTERS
from benchmarks.harness.calibration import model_flags
from benchmarks.harness.environment import collect_environment
from benchmarks.harness.loadgen import LevelPlan, OpenLevelPlan, run_level, run_open_level
from benchmarks.harness.profiles import Profile, with_weights
from benchmarks.harness.results import (
    REPO_ROOT,
    RESULTS_ROOT,
    BenchmarkResult,
    Calibration,
    LevelResult,
    LoadGenerator,
    OpenLoopConfig,
    OpenLoopLevel,
    OpenLoopResult,
    RunConfig,
    ServerRun,
    load_result,
    save_result,
)
from benchmarks.harness.server_process import pin_to_cores, running_server
from benchmarks.harness.server_stats import detect_source, server_choices
from benchmarks.harness.workload import (
    DEFAULT_SEED,
    PROMPT_ID_RANGE,
    PromptStream,
    Workload,
    check_response,
    get_workload,
)
from chapters import CHAPTERS, module_for

Progress = Callable[[str], None]
WARMUP_CONCURRENCY = 8  # enough to give a batching server a few real batches before the clock starts


def chapter_is_built(chapter: str) -> bool:
    """A chapter exists once it is registered and ``python -m chapters.<folder>`` has something to run."""
    if chapter not in CHAPTERS:
        return False
    return importlib.util.find_spec(f"{module_for(chapter)}.__main__") is not None


def climb_order(selected: Sequence[str] | None = None) -> list[str]:
    """The article's chapters and every registered one, in chapter order (or ``selected``, in that order)."""
    if selected:
        return list(selected)
    return sorted(set(ARTICLE_CHAPTERS) | set(CHAPTERS))


def results_dir(profile: Profile, out_dir: Path | None = None) -> Path:
    return out_dir if out_dir is not None else RESULTS_ROOT / profile.results_name


def server_args_for(profile: Profile, extra_args: Sequence[str] = (), weights: str | None = None) -> list[str]:
    """The profile's model and thread flags (``--weights`` replaced when given), then the run's own flags."""
    args = profile.server_args()
    if weights is not None:
        args = [a for a in args if not a.startswith("--weights")] + [f"--weights={weights}"]
    return [*args, *extra_args]


def core_plan_for(
    profile: Profile, loadgen_workers: int = 0, available: list[int] | None = None
) -> tuple[list[int] | None, list[int] | None]:
    """``(server_cores, loadgen_cores)``: the profile's plan, where Locust's workers get a core each.

    The profile gives the load generator one core. ``loadgen_workers`` workers (their master mostly
    idles) get one core per worker, taken from the end of the usable cores, as far as the server keeps
    at least one; on a machine without cores to spare they share the profile's one (recorded as such).
    """
    if available is None:
        available = list(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    available = sorted(available)
    server, loadgen = profile.core_plan(available)
    extra = min(loadgen_workers - 1, len(available) - 2)
    if server is None or extra <= 0:
        return server, loadgen
    server, first = profile.core_plan(available[: len(available) - extra])
    return server, [*first, *available[len(available) - extra:]]


def describe_load_generator(workers: int) -> str:
    """How Locust ran, in words: for the progress lines and the report."""
    if workers <= 0:
        return "one Locust process"
    return f"Locust distributed: a master and {workers} worker{'s' if workers > 1 else ''}"


def loadgen_flags(workers: int) -> list[str]:
    """The command-line flag that reproduces ``workers`` (none for the default, one process)."""
    return ["--workers", str(workers)] if workers else []


def reproduce_command(
    chapter: str, profile: Profile, workload: Workload, extra_args: Sequence[str], label: str,
    levels: Sequence[int] | None, weights: str | None, loadgen_workers: int = 0,
) -> str:
    parts = ["python", "-m", "benchmarks", "run", "--chapter", chapter, "--profile", profile.name]
    if workload.name != "default":
        parts += ["--workload", workload.name]
    if weights is not None:
        parts += ["--weights", weights]
    if levels is not None:
        parts += ["--levels", ",".join(map(str, levels))]
    parts += loadgen_flags(loadgen_workers)
    parts += [f"--server-arg={arg}" for arg in extra_args]
    if label != chapter:
        parts += ["--label", label]
    return shlex.join(parts)


def warm_up(url: str, workload: Workload, count: int, vocab_size: int, timeout_s: float) -> None:
    """Send ``count`` real requests (each prompt length once, then the rest concurrently); raise on any failure.

    A server that cannot answer its warm-up correctly would only produce misleading figures.
    """
    prompts = PromptStream(workload, seed=DEFAULT_SEED + 99, user_index=0)  # not the measured sequence

    def one(body: dict) -> None:
        response = requests.post(f"{url}/v1/inference", json=body, timeout=timeout_s)
        payload = response.json() if response.status_code == 200 else None
        reason = check_response(response.status_code, payload, workload.max_new_tokens, vocab_size)
        if reason is not None:
            raise RuntimeError(f"warm-up request failed: {reason}: {response.text[:300]}")

    for length in workload.prompt_lengths[:count]:  # every prompt shape once, one at a time
        # ids wrap at PROMPT_ID_RANGE: a prompt longer than the byte range must stay inside every vocabulary
        one({"input_ids": [i % PROMPT_ID_RANGE for i in range(length)], "max_new_tokens": workload.max_new_tokens})
    rest = [prompts.next_body() for _ in range(max(0, count - len(workload.prompt_lengths)))]
    if rest:
        with ThreadPoolExecutor(max_workers=min(WARMUP_CONCURRENCY, len(rest))) as pool:
            list(pool.map(one, rest))


CALIBRATION_TIMEOUT_S = 180.0


def run_calibration(
    profile: Profile, server_cores: list[int] | None, weights: str | None = None, progress: Progress = print
) -> Calibration | None:
    """The machine's calibration (:mod:`benchmarks.harness.calibration`) in a subprocess with the server's cores,
    thread settings and model flags; ``None`` (with a note) when it fails: the run's figures still count."""
    flags = model_flags(server_args_for(profile, weights=weights))
    command = [sys.executable, "-m", "benchmarks.harness.calibration", *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items())]
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, env={**os.environ, **profile.thread_env()}, capture_output=True, text=True,
            timeout=CALIBRATION_TIMEOUT_S, preexec_fn=pin_to_cores(server_cores),
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-1500:])
        calibration = Calibration.model_validate(json.loads(done.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, RuntimeError, ValueError) as exc:
        progress(f"calibration failed (the run goes on without it): {type(exc).__name__}: {str(exc)[:500]}")
        return None
    progress(f"calibration: {describe_calibration(calibration)} ({calibration.seconds:.1f} s)")
    return calibration


def describe_calibration(calibration: Calibration) -> str:
    def rate(values: dict, unit: str) -> str:
        return ", ".join(f"{'-' if v is None else f'{v:.1f}'} {unit} at {k}" for k, v in values.items())

    return (f"fp32 {rate(calibration.fp32_gflops, 'GFLOP/s')}; bf16 {rate(calibration.bf16_gflops, 'GFLOP/s')}; "
            f"engine {rate(calibration.engine_rps, 'req/s')}")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def describe_level(label: str, level: LevelResult) -> str:
    """The progress line of one level."""
    latency = level.latency_ms
    p50, p99 = (f"{latency.p50:.0f}", f"{latency.p99:.0f}") if latency else ("-", "-")
    line = (
        f"  {label} users={level.users:>3}: {level.qps:7.1f} QPS {level.tokens_per_s:8.0f} tok/s  "
        f"P50 {p50} ms  P99 {p99} ms  errors {sum(level.errors_by_status.values())}  "
        f"server CPU {_percent(level.server_cpu_percent)}  Locust CPU {_percent(level.loadgen_cpu_percent)}  "
        f"({level.window_s:.1f} s, {level.latency_sample} measured)"
    )
    series = level.server_series
    if series is not None and series.batches:
        line += f"  mean batch {series.requests / series.batches:.1f} (largest {max(map(int, series.batch_sizes))})"
    waits = {"server": level.server_cpu_wait_percent, "Locust": level.loadgen_cpu_wait_percent}
    busy_machine = {name: wait for name, wait in waits.items() if (wait or 0) > 10}
    if busy_machine:  # other processes took the cores: say so next to the figures they lowered
        line += "  [waited for a CPU: " + ", ".join(f"{n} {_percent(w)}" for n, w in busy_machine.items()) + "]"
    return line


def run_chapter(
    chapter: str,
    profile: Profile,
    *,
    workload: str = "default",
    extra_server_args: Sequence[str] = (),
    label: str | None = None,
    out_dir: Path | None = None,
    levels: Sequence[int] | None = None,
    weights: str | None = None,
    seed: int = DEFAULT_SEED,
    calibrate: bool = True,
    loadgen_workers: int = 0,
    progress: Progress = print,
) -> tuple[BenchmarkResult, Path]:
    """Benchmark one chapter on ``profile``; returns the validated result and the JSON file it was written to.

    ``calibrate``: measure the machine first (:mod:`benchmarks.harness.calibration`, a few seconds) and keep it in the result.
    ``loadgen_workers``: 0 runs Locust as one process; N >= 1 as a master and N workers (:func:`core_plan_for`).

    The server gets the profile's cores, thread settings and model flags, then ``extra_server_args``
    (a variant such as ``--workers=2``, which should then get its own ``label``).
    """
    profile, label = with_weights(profile, weights), label or chapter
    chosen_workload = get_workload(workload)
    chosen_levels = list(levels) if levels is not None else list(profile.levels)
    directory = results_dir(profile, out_dir)
    server_cores, loadgen_cores = core_plan_for(profile, loadgen_workers)
    environment = collect_environment(profile, server_cores, loadgen_cores)
    args = server_args_for(profile, extra_server_args, weights)
    work_dir = directory / "runs" / (label if chosen_workload.name == "default" else f"{label}-{chosen_workload.name}")
    work_dir.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    calibration = run_calibration(profile, server_cores, weights, progress) if calibrate else None
    progress(f"{label} [{profile.name}, {chosen_workload.name}, {describe_load_generator(loadgen_workers)}]: "
             f"starting {module_for(chapter)} {' '.join(args)}")

    launched = time.monotonic()
    with running_server(
        chapter, args, env=profile.server_env(), cpu_cores=server_cores, log_path=work_dir / "server.log"
    ) as server:
        startup_s = time.monotonic() - launched
        warm_up(server.url, chosen_workload, profile.warmup_requests, profile.vocab_size, profile.request_timeout_s)
        warmup_s = time.monotonic() - launched - startup_s
        stats_source = detect_source(server.url)
        level_results = []
        for users in chosen_levels:
            plan = LevelPlan(
                users=users, min_s=profile.min_level_s, max_s=profile.max_level_s,
                target_requests=profile.target_requests, workload=chosen_workload, seed=seed,
                vocab_size=profile.vocab_size, request_timeout_s=profile.request_timeout_s, workers=loadgen_workers,
                first_round_s=profile.first_round_s,
            )
            level = run_level(server.url, plan, server_pid=server.pid, loadgen_cores=loadgen_cores, work_dir=work_dir,
                              stats_source=stats_source)
            level_results.append(level)
            progress(describe_level(label, level))
        command, choices = server.command, server_choices(server.url)
    exit_code = server.process.returncode

    result = BenchmarkResult(
        chapter=chapter,
        label=label,
        started_at=started_at,
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        environment=environment,
        config=RunConfig(
            profile=profile.name, workload=chosen_workload.name, max_new_tokens=chosen_workload.max_new_tokens,
            prompt_lengths=list(chosen_workload.prompt_lengths), seed=seed, levels=chosen_levels,
            min_level_s=profile.min_level_s, max_level_s=profile.max_level_s,
            target_requests=profile.target_requests, warmup_requests=profile.warmup_requests,
            server_args=args, server_command=command,
            reproduce=reproduce_command(chapter, profile, chosen_workload, extra_server_args, label, levels, weights,
                                        loadgen_workers),
            load_generator=LoadGenerator(workers=loadgen_workers),
        ),
        server=ServerRun(startup_s=startup_s, warmup_s=warmup_s, exit_code=exit_code, choices=choices),
        levels=level_results,
        calibration=calibration,
    )
    path = save_result(result, directory)
    progress(f"{label}: wrote {path}")
    return result, path


# --------------------------------------------------------------------------------------------
# The open loop: offered rates swept upward
# --------------------------------------------------------------------------------------------


def sweep_should_stop(level: OpenLoopLevel, stop_p99_ms: float, stop_error_share: float) -> str | None:
    """Why the sweep ends after ``level`` (its P99 or its failed share past the profile's bounds), else None."""
    if level.error_share > stop_error_share:
        return f"{level.error_share:.0%} of the arrivals at {level.offered_rps:g}/s failed (bound {stop_error_share:.0%})"
    if level.latency_ms is None:
        return f"no successful request at {level.offered_rps:g}/s"
    if level.latency_ms.p99 > stop_p99_ms:
        return f"P99 {level.latency_ms.p99:.0f} ms at {level.offered_rps:g}/s exceeds {stop_p99_ms:.0f} ms"
    return None


def describe_open_level(label: str, level: OpenLoopLevel) -> str:
    latency = level.latency_ms
    p50, p99 = (f"{latency.p50:.0f}", f"{latency.p99:.0f}") if latency else ("-", "-")
    return (
        f"  {label} offered {level.offered_rps:6.1f}/s: achieved {level.qps:6.1f}/s goodput {level.goodput_rps:6.1f}/s  "
        f"P50 {p50} ms  P99 {p99} ms  failed {level.requests_failed}/{level.arrivals} (dropped {level.dropped}, "
        f"unanswered {level.unfinished})  in flight <= {level.max_outstanding_seen}  "
        f"server CPU {_percent(level.server_cpu_percent)}  Locust CPU {_percent(level.loadgen_cpu_percent)}"
    )


def open_loop_reproduce(chapter: str, profile: Profile, workload: Workload, rates: Sequence[float] | None,
                        weights: str | None, extra_args: Sequence[str], label: str, loadgen_workers: int = 0) -> str:
    parts = ["python", "-m", "benchmarks", "openloop", "--chapters", chapter, "--profile", profile.name]
    if workload.name != "default":
        parts += ["--workload", workload.name]
    if rates is not None:
        parts += ["--rates", ",".join(f"{r:g}" for r in rates)]
    if weights is not None:
        parts += ["--weights", weights]
    parts += loadgen_flags(loadgen_workers)
    parts += [f"--server-arg={arg}" for arg in extra_args]
    if label != chapter:
        parts += ["--label", label]
    return shlex.join(parts)


def run_open_loop(
    chapter: str,
    profile: Profile,
    *,
    rates: Sequence[float] | None = None,
    workload: str = "default",
    extra_server_args: Sequence[str] = (),
    label: str | None = None,
    out_dir: Path | None = None,
    weights: str | None = None,
    seed: int = DEFAULT_SEED,
    calibrate: bool = True,
    loadgen_workers: int = 0,
    progress: Progress = print,
) -> tuple[OpenLoopResult, Path]:
    """Sweep ``chapter`` with Poisson arrivals at each offered rate of the profile (or ``rates``), upward,
    on one server; stop after the first rate that breaks the profile's bounds. Writes
    ``<out>/openloop/<label>.json``; returns the result and its path. ``loadgen_workers`` N >= 1 splits
    each rate between N Locust workers (their arrivals add up to the rate)."""
    profile, settings = with_weights(profile, weights), profile.open_loop
    if settings is None:
        raise ValueError(f"the {profile.name!r} profile has no open-loop settings")
    label = label or chapter
    chosen_workload = get_workload(workload)
    ladder = sorted(float(r) for r in (rates if rates is not None else settings.rates))
    if not ladder or ladder[0] <= 0:
        raise ValueError(f"offered rates must be positive, got {ladder}")
    directory = results_dir(profile, out_dir)
    server_cores, loadgen_cores = core_plan_for(profile, loadgen_workers)
    environment = collect_environment(profile, server_cores, loadgen_cores)
    args = server_args_for(profile, extra_server_args, weights)
    work_dir = directory / "runs" / "openloop" / (label if chosen_workload.name == "default" else f"{label}-{chosen_workload.name}")
    work_dir.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    calibration = run_calibration(profile, server_cores, weights, progress) if calibrate else None
    progress(f"{label} open loop [{profile.name}, {describe_load_generator(loadgen_workers)}]: "
             f"rates {', '.join(f'{r:g}' for r in ladder)}/s")
    launched = time.monotonic()
    stopped = None
    with running_server(
        chapter, args, env=profile.server_env(), cpu_cores=server_cores, log_path=work_dir / "server.log"
    ) as server:
        startup_s = time.monotonic() - launched
        warm_up(server.url, chosen_workload, profile.warmup_requests, profile.vocab_size, profile.request_timeout_s)
        warmup_s = time.monotonic() - launched - startup_s
        stats_source = detect_source(server.url)
        levels = []
        for rate in ladder:
            plan = OpenLevelPlan(
                rate=rate, lead_in_s=settings.lead_in_s, window_s=settings.window_s(rate), drain_s=settings.drain_s,
                max_outstanding=settings.max_outstanding, slo_ms=settings.slo_ms, workload=chosen_workload,
                seed=seed, vocab_size=profile.vocab_size, request_timeout_s=profile.request_timeout_s,
                workers=loadgen_workers,
            )
            level = run_open_level(server.url, plan, server_pid=server.pid, loadgen_cores=loadgen_cores,
                                   work_dir=work_dir, stats_source=stats_source)
            levels.append(level)
            progress(describe_open_level(label, level))
            stopped = sweep_should_stop(level, settings.stop_p99_ms, settings.stop_error_share)
            if stopped is not None:
                progress(f"  {label}: sweep stopped: {stopped}")
                break
        command, choices = server.command, server_choices(server.url)
    result = OpenLoopResult(
        chapter=chapter, label=label, started_at=started_at,
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        environment=environment,
        config=OpenLoopConfig(
            profile=profile.name, workload=chosen_workload.name, max_new_tokens=chosen_workload.max_new_tokens,
            prompt_lengths=list(chosen_workload.prompt_lengths), seed=seed, rates=ladder,
            lead_in_s=settings.lead_in_s, min_level_s=settings.min_level_s, max_level_s=settings.max_level_s,
            target_requests=settings.target_requests, drain_s=settings.drain_s,
            max_outstanding=settings.max_outstanding, slo_ms=settings.slo_ms, stop_p99_ms=settings.stop_p99_ms,
            stop_error_share=settings.stop_error_share, server_args=args, server_command=command,
            reproduce=open_loop_reproduce(chapter, profile, chosen_workload, rates, weights, extra_server_args, label,
                                          loadgen_workers),
            load_generator=LoadGenerator(workers=loadgen_workers),
        ),
        server=ServerRun(startup_s=startup_s, warmup_s=warmup_s, exit_code=server.process.returncode, choices=choices),
        levels=levels,
        stopped=stopped,
        calibration=calibration,
    )
    path = save_result(result, directory)
    progress(f"{label}: wrote {path}")
    return result, path


def open_loop_climb(
    profile: Profile,
    *,
    chapters: Sequence[str] | None = None,
    progress: Progress = print,
    **options,
) -> ClimbOutcome:
    """:func:`run_open_loop` for every chapter (built ones), in order; a failing chapter is reported, the rest go on."""
    outcome = ClimbOutcome()
    for chapter in climb_order(chapters):
        if not chapter_is_built(chapter):
            outcome.skipped[chapter] = "not built yet"
            continue
        began = time.monotonic()
        try:
            _, path = run_open_loop(chapter, profile, progress=progress, **options)
        except Exception as exc:  # noqa: BLE001 - one broken chapter must not hide the others' figures
            outcome.failed[chapter] = f"{type(exc).__name__}: {exc}"
            progress(f"{chapter}: FAILED: {outcome.failed[chapter][:2000]}")
            continue
        outcome.written[chapter] = path
        progress(f"{chapter}: open loop done in {time.monotonic() - began:.0f} s")
    return outcome


@dataclass
class ClimbOutcome:
    written: dict[str, Path] = field(default_factory=dict)  # chapter -> results file
    skipped: dict[str, str] = field(default_factory=dict)  # chapter -> why
    failed: dict[str, str] = field(default_factory=dict)  # chapter -> error


def climb(
    profile: Profile,
    *,
    chapters: Sequence[str] | None = None,
    workload: str = "default",
    out_dir: Path | None = None,
    levels: Sequence[int] | None = None,
    weights: str | None = None,
    loadgen_workers: int = 0,
    progress: Progress = print,
) -> ClimbOutcome:
    """Every chapter in order on the same profile; chapters not built yet are skipped with a note.

    A chapter that fails (its server does not start, a warm-up answer is wrong) is reported and the
    climb goes on: the other chapters' figures are still worth having.
    """
    outcome = ClimbOutcome()
    order = climb_order(chapters)
    for position, chapter in enumerate(order, start=1):
        if not chapter_is_built(chapter):
            outcome.skipped[chapter] = "not built yet"
            progress(f"[{position}/{len(order)}] {chapter}: skipped (not built yet)")
            continue
        progress(f"[{position}/{len(order)}] {chapter}")
        began = time.monotonic()
        try:
            _, path = run_chapter(
                chapter, profile, workload=workload, out_dir=out_dir, levels=levels, weights=weights,
                loadgen_workers=loadgen_workers, progress=progress,
            )
        except Exception as exc:  # noqa: BLE001 - one broken chapter must not hide the others' figures
            outcome.failed[chapter] = f"{type(exc).__name__}: {exc}"
            progress(f"{chapter}: FAILED: {outcome.failed[chapter][:2000]}")
            continue
        outcome.written[chapter] = path
        progress(f"{chapter}: done in {time.monotonic() - began:.0f} s")
    return outcome


def saturation_qps(path: Path) -> float:
    saturation = load_result(path).saturation()
    return saturation.qps if saturation else 0.0


def median_run(paths: Sequence[Path]) -> Path:
    """Of several runs of one chapter, the one whose saturation QPS is the median (the lower middle
    for an even count): a real run, its latencies and environment intact, not an average of runs."""
    if not paths:
        raise ValueError("no runs to choose from")
    qps = {path: saturation_qps(path) for path in paths}  # each file read once
    by_qps = sorted(paths, key=qps.__getitem__)
    return by_qps[(len(by_qps) - 1) // 2]


def climb_repeated(
    profile: Profile,
    repeat: int,
    *,
    out_dir: Path | None = None,
    progress: Progress = print,
    **climb_args,
) -> ClimbOutcome:
    """``repeat`` rounds of the whole climb, interleaved (ch01..ch06, ch01..ch06, ...) so a slow
    spell of a shared machine hits every chapter alike; each chapter keeps its median run, copied to
    the results directory where a single climb would have written it."""
    directory = results_dir(profile, out_dir)
    rounds = [climb(profile, out_dir=directory / "rounds" / f"round{r}", progress=progress, **climb_args)
              for r in range(1, repeat + 1)]
    outcome = ClimbOutcome(skipped=rounds[0].skipped)
    for chapter in sorted({c for o in rounds for c in (*o.written, *o.failed)}):
        runs = [o.written[chapter] for o in rounds if chapter in o.written]
        failures = [o.failed[chapter] for o in rounds if chapter in o.failed]
        if failures:
            outcome.failed[chapter] = failures[0]
            continue
        chosen = median_run(runs)
        qps = sorted(saturation_qps(path) for path in runs)
        target = directory / chosen.name
        shutil.copyfile(chosen, target)
        outcome.written[chapter] = target
        progress(f"{chapter}: median of {len(runs)} runs kept ({', '.join(f'{q:.1f}' for q in qps)} QPS)")
    return outcome
