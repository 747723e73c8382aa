"""The harness's own ceiling: how many requests per second Locust can send from its core at all.

Locust runs exactly as in a chapter's benchmark (same locustfile, same validation, same core) against
``benchmarks.harness.trivial_server``, which answers instantly. The highest QPS reached is the ceiling: a
chapter measured near it is measuring the load generator. Written as ``ceiling.json`` (the same
schema as a chapter, chapter ``ceiling``) next to the chapters' results; the report quotes it.

``workers`` N >= 1 measures Locust's distributed mode instead (a master and N workers, each worker on
its own core where the machine has one to spare), written as ``ceiling-workers<N>.json`` beside it, so
that the ceilings of one process, one worker and two workers can be compared.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, UTC
from pathlib import Path

from benchmarks.harness.climb import (
    Progress,
    core_plan_for,
    describe_level,
    describe_load_generator,
    loadgen_flags,
    results_dir,
)
from benchmarks.harness.environment import collect_environment
from benchmarks.harness.loadgen import LevelPlan, run_level
from benchmarks.harness.profiles import Profile
from benchmarks.harness.results import BenchmarkResult, LoadGenerator, RunConfig, ServerRun, save_result
from benchmarks.harness.server_process import running_module
from benchmarks.harness.workload import DEFAULT_SEED, get_workload

CEILING_LEVELS = (1, 8, 32, 64)


def ceiling_label(workers: int) -> str:
    """``ceiling`` for one Locust process (the one the report quotes first), ``ceiling-workers<N>`` otherwise."""
    return "ceiling" if workers <= 0 else f"ceiling-workers{workers}"


def run_ceiling(
    profile: Profile, *, out_dir: Path | None = None, levels: Sequence[int] | None = None, workers: int = 0,
    progress: Progress = print,
) -> tuple[BenchmarkResult, Path]:
    """Load the trivial server at each level for the profile's minimum level time; write ``<label>.json``
    (:func:`ceiling_label`).

    The trivial server gets the server's cores, Locust its own, as for a chapter (``workers`` >= 1: a
    master and that many workers, :func:`benchmarks.harness.core_plan_for`).
    """
    workload = get_workload("default")
    chosen_levels = list(levels) if levels is not None else sorted(set(CEILING_LEVELS) | set(profile.levels))
    label = ceiling_label(workers)
    directory = results_dir(profile, out_dir)
    work_dir = directory / "runs" / label
    work_dir.mkdir(parents=True, exist_ok=True)
    server_cores, loadgen_cores = core_plan_for(profile, workers)
    environment = collect_environment(profile, server_cores, loadgen_cores)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    progress(f"ceiling [{profile.name}, {describe_load_generator(workers)}]: Locust against an instant endpoint")
    launched = time.monotonic()
    with running_module(
        "benchmarks.harness.trivial_server", name="ceiling", cpu_cores=server_cores, log_path=work_dir / "server.log"
    ) as server:
        startup_s = time.monotonic() - launched
        level_results = []
        for users in chosen_levels:
            # No early stop: a fixed time, so the client runs flat out for as long at every level.
            plan = LevelPlan(
                users=users, min_s=profile.min_level_s, max_s=profile.min_level_s, target_requests=0,
                workload=workload, seed=DEFAULT_SEED, vocab_size=profile.vocab_size,
                request_timeout_s=profile.request_timeout_s, workers=workers,
            )
            level = run_level(server.url, plan, server_pid=server.pid, loadgen_cores=loadgen_cores, work_dir=work_dir)
            level_results.append(level)
            progress(describe_level(label, level))
        command = server.command
    result = BenchmarkResult(
        chapter="ceiling",
        label=label,
        started_at=started_at,
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
        environment=environment,
        config=RunConfig(
            profile=profile.name, workload=workload.name, max_new_tokens=workload.max_new_tokens,
            prompt_lengths=list(workload.prompt_lengths), seed=DEFAULT_SEED, levels=chosen_levels,
            min_level_s=profile.min_level_s, max_level_s=profile.min_level_s, target_requests=0,
            warmup_requests=0, server_args=[], server_command=command,
            reproduce=" ".join(["python -m benchmarks ceiling --profile", profile.name, *loadgen_flags(workers)]),
            load_generator=LoadGenerator(workers=workers),
        ),
        server=ServerRun(startup_s=startup_s, warmup_s=0.0, exit_code=server.process.returncode),
        levels=level_results,
    )
    path = save_result(result, directory)
    top = result.saturation()
    progress(f"{label}: {top.qps:,.0f} QPS at {top.users} users; wrote {path}")
    return result, path
