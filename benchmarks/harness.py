"""Measure a chapter: start its server, warm it up, load it at each level of a profile, write the results.

One chapter (:func:`run_chapter`) or every chapter in order (:func:`climb`). Everything a figure
depends on is set explicitly and recorded: the model flags, the thread count and thread variables,
the cores of the server and of the load generator, the workload and its seed.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import requests

from benchmarks.article import ARTICLE_CHAPTERS
from benchmarks.environment import collect_environment
from benchmarks.loadgen import LevelPlan, run_level
from benchmarks.profiles import Profile
from benchmarks.results import (
    RESULTS_ROOT,
    BenchmarkResult,
    LevelResult,
    RunConfig,
    ServerRun,
    load_result,
    save_result,
)
from benchmarks.server_process import running_server
from benchmarks.workload import (
    DEFAULT_SEED,
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
    return out_dir if out_dir is not None else RESULTS_ROOT / profile.name


def server_args_for(profile: Profile, extra_args: Sequence[str] = (), weights: str | None = None) -> list[str]:
    """The profile's model and thread flags (``--weights`` replaced when given), then the run's own flags."""
    args = profile.server_args()
    if weights is not None:
        args = [a for a in args if not a.startswith("--weights")] + [f"--weights={weights}"]
    return [*args, *extra_args]


def reproduce_command(
    chapter: str, profile: Profile, workload: Workload, extra_args: Sequence[str], label: str,
    levels: Sequence[int] | None, weights: str | None,
) -> str:
    parts = ["python", "-m", "benchmarks", "run", "--chapter", chapter, "--profile", profile.name]
    if workload.name != "default":
        parts += ["--workload", workload.name]
    if weights is not None:
        parts += ["--weights", weights]
    if levels is not None:
        parts += ["--levels", ",".join(map(str, levels))]
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
        one({"input_ids": list(range(length)), "max_new_tokens": workload.max_new_tokens})
    rest = [prompts.next_body() for _ in range(max(0, count - len(workload.prompt_lengths)))]
    if rest:
        with ThreadPoolExecutor(max_workers=min(WARMUP_CONCURRENCY, len(rest))) as pool:
            list(pool.map(one, rest))


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
    progress: Progress = print,
) -> tuple[BenchmarkResult, Path]:
    """Benchmark one chapter on ``profile``; returns the validated result and the JSON file it was written to.

    The server gets the profile's cores, thread settings and model flags, then ``extra_server_args``
    (a variant such as ``--workers=2``, which should then get its own ``label``).
    """
    label = label or chapter
    chosen_workload = get_workload(workload)
    chosen_levels = list(levels) if levels is not None else list(profile.levels)
    directory = results_dir(profile, out_dir)
    server_cores, loadgen_cores = profile.core_plan()
    environment = collect_environment(profile, server_cores, loadgen_cores)
    args = server_args_for(profile, extra_server_args, weights)
    work_dir = directory / "runs" / (label if chosen_workload.name == "default" else f"{label}-{chosen_workload.name}")
    work_dir.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    progress(f"{label} [{profile.name}, {chosen_workload.name}]: starting {module_for(chapter)} {' '.join(args)}")

    launched = time.monotonic()
    with running_server(
        chapter, args, env=profile.server_env(), cpu_cores=server_cores, log_path=work_dir / "server.log"
    ) as server:
        startup_s = time.monotonic() - launched
        warm_up(server.url, chosen_workload, profile.warmup_requests, profile.vocab_size, profile.request_timeout_s)
        warmup_s = time.monotonic() - launched - startup_s
        level_results = []
        for users in chosen_levels:
            plan = LevelPlan(
                users=users, min_s=profile.min_level_s, max_s=profile.max_level_s,
                target_requests=profile.target_requests, workload=chosen_workload, seed=seed,
                vocab_size=profile.vocab_size, request_timeout_s=profile.request_timeout_s,
            )
            level = run_level(server.url, plan, server_pid=server.pid, loadgen_cores=loadgen_cores, work_dir=work_dir)
            level_results.append(level)
            progress(describe_level(label, level))
        command = server.command
    exit_code = server.process.returncode

    result = BenchmarkResult(
        chapter=chapter,
        label=label,
        started_at=started_at,
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        environment=environment,
        config=RunConfig(
            profile=profile.name, workload=chosen_workload.name, max_new_tokens=chosen_workload.max_new_tokens,
            prompt_lengths=list(chosen_workload.prompt_lengths), seed=seed, levels=chosen_levels,
            min_level_s=profile.min_level_s, max_level_s=profile.max_level_s,
            target_requests=profile.target_requests, warmup_requests=profile.warmup_requests,
            server_args=args, server_command=command,
            reproduce=reproduce_command(chapter, profile, chosen_workload, extra_server_args, label, levels, weights),
        ),
        server=ServerRun(startup_s=startup_s, warmup_s=warmup_s, exit_code=exit_code),
        levels=level_results,
    )
    path = save_result(result, directory)
    progress(f"{label}: wrote {path}")
    return result, path


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
                chapter, profile, workload=workload, out_dir=out_dir, levels=levels, weights=weights, progress=progress
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
