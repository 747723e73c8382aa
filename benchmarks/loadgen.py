"""Run one concurrency level: Locust headless as a subprocess, its records turned into the level's figures.

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

from benchmarks.results import REPO_ROOT, LevelResult, summarize_level
from benchmarks.sampling import ResourceSampler
from benchmarks.server_process import pin_to_cores
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


def locust_command(url: str, plan: LevelPlan, csv_prefix: Path) -> list[str]:
    run_time_s = int(round(plan.max_s + FIRST_ROUND_ALLOWANCE_S))
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(plan.users), "-r", str(plan.users), "-t", f"{run_time_s}s",
        "--host", url, "--csv", str(csv_prefix), "--only-summary",
        "--loglevel", "WARNING", "--exit-code-on-error", "0",
    ]


def locust_env(plan: LevelPlan, records_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "SFS_BENCH_WORKLOAD": plan.workload.name,
        "SFS_BENCH_SEED": str(plan.seed),
        "SFS_BENCH_VOCAB_SIZE": str(plan.vocab_size),
        "SFS_BENCH_TIMEOUT_S": str(plan.request_timeout_s),
        "SFS_BENCH_RECORDS": str(records_path),
        "SFS_BENCH_TARGET_REQUESTS": str(plan.target_requests),
        "SFS_BENCH_MIN_SECONDS": str(plan.min_s),
        "SFS_BENCH_MAX_SECONDS": str(plan.max_s),
    }


def run_level(
    url: str, plan: LevelPlan, *, server_pid: int, loadgen_cores: list[int] | None, work_dir: Path
) -> LevelResult:
    """Run Locust at ``plan.users`` against ``url`` and summarise it; the server must already be warm.

    Locust's CSV files and log stay in ``work_dir`` (``level-<users>*``) for inspection.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    stem = work_dir / f"level-{plan.users}"
    records_path = stem.with_suffix(".records.json")
    records_path.unlink(missing_ok=True)
    log_path = stem.with_suffix(".locust.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            locust_command(url, plan, stem), cwd=REPO_ROOT, env=locust_env(plan, records_path),
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin_to_cores(loadgen_cores),
        )
        sampler = ResourceSampler({"server": server_pid, "loadgen": process.pid}).start()
        try:
            exit_code = process.wait(timeout=plan.max_s + FIRST_ROUND_ALLOWANCE_S + PROCESS_GRACE_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Locust did not finish the level at {plan.users} users; log: {log_path}") from None
        finally:
            if process.poll() is None:  # timed out, or the harness itself was interrupted: leave nothing behind
                process.kill()
                process.wait()
            sampler.stop()
    if not records_path.exists():
        raise RuntimeError(f"Locust wrote no records (exit {exit_code}):\n{log_path.read_text(errors='replace')[-3000:]}")
    run = json.loads(records_path.read_text())
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
    )
