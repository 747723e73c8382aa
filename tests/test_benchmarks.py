"""The harness end to end on the smoke profile: real servers, real Locust, schema-valid results.

Nothing here depends on a timing: a level must have *some* successful throughput and no errors,
whatever the machine's speed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.climb import chapter_is_built
from benchmarks.harness.profiles import get_profile
from benchmarks.harness.results import load_result
from chapters import CHAPTERS

REPO_ROOT = Path(__file__).resolve().parent.parent
# Both in `make test-slow` (ch01: gunicorn's process tree under the harness). Every run still drives
# the harness end to end against a real server: test_batch_sizes_are_recorded_from_the_server (ch03).
SMOKE_CHAPTERS = [pytest.param(chapter, marks=pytest.mark.slow) for chapter in ("ch01", "ch02") if chapter in CHAPTERS]
CLEAN_EXITS = (0, -15)  # gunicorn exits 0; uvicorn re-raises SIGTERM after its graceful shutdown


@pytest.mark.parametrize("chapter", SMOKE_CHAPTERS)
def test_smoke_profile_writes_valid_results(chapter: str, tmp_path: Path):
    if not chapter_is_built(chapter):
        pytest.skip(f"{chapter} is registered but not built yet (no __main__.py)")
    calibrate = chapter == "ch02"  # a few seconds: once is enough to check it lands in the file
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--chapter", chapter, "--profile", "smoke", "--out", str(tmp_path),
         *([] if calibrate else ["--no-calibration"])],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = load_result(tmp_path / f"{chapter}.json")  # validates against the schema
    smoke = get_profile("smoke")
    assert result.chapter == chapter and result.config.profile == "smoke"
    assert [level.users for level in result.levels] == list(smoke.levels) and result.schema_version == 2
    for level in result.levels:
        assert level.qps > 0 and level.tokens_per_s > 0
        assert level.requests_failed == 0 and level.errors_by_status == {}
        assert level.latency_ms is not None and 0 < level.latency_ms.p50 <= level.latency_ms.p99 <= level.latency_ms.max
        assert level.locust_exit_code == 0
    assert result.server.exit_code in CLEAN_EXITS
    env = result.environment
    assert env.torch_threads == 1 and env.thread_env["OMP_NUM_THREADS"] == "1"
    assert "--torch-threads=1" in result.config.server_args
    assert result.config.reproduce == f"python -m benchmarks run --chapter {chapter} --profile smoke"
    # the run also redraws the report next to the results
    assert (tmp_path / "climb.md").exists() and (tmp_path / "climb.png").exists()
    assert f"| {chapter} |" in (tmp_path / "climb.md").read_text()
    # schema 2: the server's stage timings per level, a sample of requests, resources over time, calibration
    for level in result.levels:
        assert level.stages_ms is not None and "total" in level.stages_ms
        assert level.stages_ms["total"].count == level.latency_sample
        assert len(level.samples.latency_ms) == min(level.latency_sample, 300)
        assert level.resource_series and all(p.server_rss_mb for p in level.resource_series)
    if calibrate:
        assert result.calibration is not None and result.calibration.engine_rps["1"] > 0
    else:
        assert result.calibration is None


@pytest.mark.slow
def test_open_loop_sweep_on_the_smoke_profile(tmp_path: Path):
    from benchmarks.harness.results import load_open_loop_result

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "openloop", "--chapters", "ch02", "--profile", "smoke", "--rates", "2,4",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = load_open_loop_result(tmp_path / "openloop" / "ch02.json")
    assert [level.offered_rps for level in result.levels] == [2.0, 4.0] and result.stopped is None
    for level in result.levels:
        assert level.arrivals > 0 and level.requests_failed == 0 and level.stages_ms is not None
    assert result.config.reproduce == "python -m benchmarks openloop --chapters ch02 --profile smoke --rates 2,4"
    assert "Open loop (Poisson arrivals" in (tmp_path / "climb.md").read_text()
    assert (tmp_path / "openloop.png").exists()


@pytest.mark.skipif(not chapter_is_built("ch03"), reason="ch03 not built")
def test_batch_sizes_are_recorded_from_the_server(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", "--chapter", "ch03", "--profile", "smoke", "--levels", "4",
         "--no-calibration", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = load_result(tmp_path / "ch03.json")
    assert result.calibration is None
    (level,) = result.levels
    series = level.server_series
    assert series is not None and series.source in ("stats", "healthz")
    # the histogram's delta accounts for exactly the batches and requests the counters moved by
    assert sum(series.batch_sizes.values()) == series.batches > 0
    assert sum(int(size) * count for size, count in series.batch_sizes.items()) == series.requests
    assert max(int(size) for size in series.batch_sizes) <= 4  # never more requests in a batch than in flight
    # every request of the level went through the batcher: at least the measured ones (the first round too)
    assert series.requests >= level.requests_ok + level.requests_failed
    assert len(series.points) >= 2 and all("t_s" in point for point in series.points)
    assert result.server.choices == {}  # chapter 3 has no start-up rule (chapter 5's engine comes later)


@pytest.mark.slow
def test_ceiling_runs_against_the_trivial_server(tmp_path: Path):
    from benchmarks.harness.ceiling import run_ceiling

    result, path = run_ceiling(get_profile("smoke"), out_dir=tmp_path, levels=[4], progress=lambda _: None)
    assert path.name == "ceiling.json" and load_result(path).chapter == "ceiling"
    assert result.levels[0].qps > 0 and result.levels[0].requests_failed == 0
