"""What the harness records beyond the level's figures (schema 2): stage timings, request samples, the
server's batch sizes and series, the calibration, and the open loop with its knee.

Pure functions on hand-computed inputs, plus the open loop against the harness's instant server.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from pathlib import Path

import pytest

from benchmarks.harness.calibration import combined_gflops, model_flags
from benchmarks.harness.results import (
    MAX_REQUEST_SAMPLES,
    REFERENCE_ROOT,
    MatmulRate,
    dumps_compact,
    load_open_loop_results,
    load_result,
    load_results,
    save_result,
)
from benchmarks.harness.server_stats import batch_counters, flatten_numbers, histogram_delta, server_choices
from benchmarks.harness.summaries import evenly_chosen, summarize_level, summarize_open_level
from benchmarks.report import calibration_report, write_report
from benchmarks.report.knees import find_open_knee, open_knee_of
from benchmarks.report.notebook_plots import expected_padding
from benchmarks.report.tables import common_levels, common_rates, render_open_loop, render_same_load
from synthetic_results import (
    SyntheticLevel,
    rich_synthetic_result,
    synthetic_open_loop,
    synthetic_result,
    write_synthetic_reference,
)

# ---------------------------------------------------------------- old files


def test_a_committed_version_1_file_still_loads():
    # The previous machine's reference, kept for comparison, was written with schema 1.
    path = REFERENCE_ROOT / "cpu-previous" / "ch03.json"
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 1
    result = load_result(path)
    assert result.schema_version == 1 and result.calibration is None
    assert all(level.stages_ms is None and level.samples is None and level.server_series is None
               for level in result.levels)
    assert result.saturation().qps == max(level["qps"] for level in raw["levels"])


def test_an_unknown_schema_version_is_refused(tmp_path: Path):
    result = synthetic_result("ch01", [SyntheticLevel(1, 10, 50, 60)])
    path = save_result(result, tmp_path)
    path.write_text(path.read_text().replace('"schema_version": 2', '"schema_version": 99'))
    with pytest.raises(ValueError, match="schema version 99"):
        load_result(path)
    assert load_results(tmp_path) == {}  # the report skips it instead of failing


def test_rich_results_round_trip_and_stay_small(tmp_path: Path):
    result = rich_synthetic_result("ch04")
    path = save_result(result, tmp_path)
    assert load_result(path) == result
    assert path.stat().st_size < 150_000  # 4 levels x 300 sampled requests, one line per column


def test_dumps_compact_keeps_scalar_lists_on_one_line():
    text = dumps_compact({"a": [1, 2.5, None], "b": {"c": "x"}, "d": [{"e": 1}]})
    assert json.loads(text) == {"a": [1, 2.5, None], "b": {"c": "x"}, "d": [{"e": 1}]}
    assert '"a": [1,2.5,null]' in text and '"b": {"c": "x"}' in text


# ---------------------------------------------------------------- stage timings and samples


def _record(start: float, latency_s: float, ok: bool = True, timings: dict | None = None, prompt: int = 16) -> list:
    return [start, latency_s, 200 if ok else 503, ok, 32 if ok else 0, None if ok else "HTTP 503", timings, prompt]


def test_stage_summaries_cover_the_successful_requests_of_the_window():
    records = [
        _record(10.0, 0.10, timings={"queue": 10.0, "inference": 80.0, "total": 95.0}),
        _record(10.5, 0.20, timings={"queue": 30.0, "inference": 160.0, "total": 195.0}),
        _record(11.0, 0.30, timings={"queue": 50.0, "inference": 240.0, "total": 295.0, "fallback": 7.0}),
        _record(11.2, 0.05, ok=False, timings=None),  # a failure: no timings, not in the sample
        _record(5.0, 0.10, timings={"queue": 999.0}),  # finished before the window
    ]
    level = summarize_level(records, 10.0, 20.0, users=2, stopped_by="time_limit", locust_exit_code=0)
    stages = level.stages_ms
    assert set(stages) == {"queue", "inference", "total", "fallback"}
    assert (stages["queue"].count, stages["queue"].p50, stages["queue"].mean) == (3, 30.0, 30.0)
    assert stages["queue"].p90 == pytest.approx(46.0)  # numpy linear: rank 1.8 between 30 and 50
    assert (stages["fallback"].count, stages["fallback"].p99) == (1, 7.0)  # only the answers that had it
    samples = level.samples
    assert samples.latency_ms == [100.0, 200.0, 300.0]
    assert samples.finished_s == [pytest.approx(0.1), pytest.approx(0.7), pytest.approx(1.3)]
    assert samples.stages_ms["fallback"] == [None, None, 7.0] and samples.prompt_tokens == [16, 16, 16]


def test_version_1_records_without_timings_give_no_stage_summaries():
    level = summarize_level([[10.0, 0.1, 200, True, 32, None]], 10.0, 11.0, users=1, stopped_by="time_limit",
                            locust_exit_code=0)
    assert level.stages_ms is None and level.samples.stages_ms == {} and level.samples.prompt_tokens == [None]


def test_samples_are_bounded_and_spread_over_the_level():
    records = [_record(10.0 + i * 0.01, 0.001 * (i + 1), timings={"total": float(i)}) for i in range(1000)]
    level = summarize_level(records, 10.0, 30.0, users=8, stopped_by="time_limit", locust_exit_code=0)
    assert level.latency_sample == 1000 and level.stages_ms["total"].count == 1000  # summaries use every request
    assert len(level.samples.latency_ms) == MAX_REQUEST_SAMPLES
    assert level.samples.stages_ms["total"][0] == 0.0 and level.samples.stages_ms["total"][-1] == 999.0
    assert evenly_chosen(list(range(10)), 4) == [0, 3, 6, 9] and evenly_chosen([1, 2], 5) == [1, 2]


# ---------------------------------------------------------------- the server's own figures


def test_batch_histogram_delta_and_flattening():
    before = {"batcher": {"batches": 10, "requests": 30, "batch_sizes": {"1": 4, "4": 2, "9": 2}}, "pool": {"use": 0.5}}
    after = {"batcher": {"batches": 15, "requests": 53, "batch_sizes": {"1": 5, "4": 2, "9": 2, "16": 1, "2": 3}}}
    sizes_before, batches_before, _ = batch_counters(before)
    sizes_after, batches_after, requests_after = batch_counters(after)
    delta = histogram_delta(sizes_before, sizes_after)
    assert delta == {"1": 1, "2": 3, "16": 1}  # sizes with no new batch left out, sorted by size
    assert sum(delta.values()) == batches_after - batches_before  # 5 new batches
    assert sum(int(size) * count for size, count in delta.items()) == requests_after - 30  # 1 + 2 x 3 + 16
    assert flatten_numbers({**before, "ok": True, "name": "x"}) == {
        "batcher.batches": 10.0, "batcher.requests": 30.0, "pool.use": 0.5}
    with pytest.raises(ValueError, match="restart"):
        histogram_delta({"4": 3}, {"4": 1})
    assert batch_counters({"pool": {}}) == ({}, None, None)


# ---------------------------------------------------------------- the open loop


def test_open_level_counts_arrivals_in_the_window_and_deliveries_by_finish():
    window = (100.0, 110.0)
    records = [
        _record(99.5, 0.8),  # arrived in the lead-in, delivered inside: counts for the achieved rate only
        _record(99.8, 0.5),  # the same
        _record(100.0, 0.2),  # arrival at the window's start: measured, 200 ms
        _record(104.0, 1.5),  # 1500 ms: over a 1000 ms SLO
        _record(105.0, 0.3, ok=False),  # a 503
        _record(109.9, 0.4),  # arrived inside, finished after: measured latency, not delivered in the window
        _record(110.0, 0.1),  # arrived at the window's end: not measured (half-open window), finished after it
    ]
    level = summarize_open_level(
        records, *window, offered_rps=1.0, dropped_at=[103.0, 99.0], unfinished_at=[108.0], max_outstanding_seen=5,
        slo_ms=1000.0, locust_exit_code=0,
    )
    # arrivals inside: 4 records + 1 dropped (103.0) + 1 unanswered (108.0); the drop at 99.0 was in the lead-in
    assert (level.arrivals, level.dropped, level.unfinished) == (6, 1, 1)
    assert level.arrival_rps == pytest.approx(0.6)
    assert level.requests_ok == 3 and level.requests_failed == 3
    assert level.errors_by_status == {"0": 1, "503": 1, "dropped": 1}
    assert level.error_share == pytest.approx(0.5)
    assert level.qps == pytest.approx(4 / 10)  # delivered inside: 100.3, 100.3, 100.2, 105.5
    assert level.goodput_rps == pytest.approx(2 / 10)  # 200 and 400 ms within the SLO; 1500 ms not
    assert level.latency_ms.p50 == pytest.approx(400.0) and level.latency_ms.max == pytest.approx(1500.0)


@pytest.mark.parametrize(
    ("achieved", "arrived", "p99", "errors", "knee", "broke_at", "reasons"),
    [
        # P99 stays within 3 x 100 until 20/s (350 > 300): the knee is 10/s
        ([2, 5, 10, 19.5], [2, 5, 10, 20], [100, 120, 200, 350], [0, 0, 0, 0], 10, 20, ("p99_tripled",)),
        # exactly 3 x the lowest P99 is still linear; nothing breaks: beyond the top rate
        ([2, 5, 10, 20], [2, 5, 10, 20], [100, 150, 250, 300], [0, 0, 0, 0], 20, None, ()),
        # the server delivers 17 of 20 arrivals per second (85 % < 95 %) while P99 is still low
        ([2, 5, 10, 17], [2, 5, 10, 20], [100, 110, 120, 150], [0, 0, 0, 0], 10, 20, ("achieved_below_offered",)),
        # a Poisson draw below the nominal rate is no break: 4.1 delivered of 4.2 arrived at a nominal 5/s
        ([2, 4.1, 10, 20], [2, 4.2, 10, 20], [100, 110, 120, 150], [0, 0, 0, 0], 20, None, ()),
        # 2 % of the arrivals failed at 10/s
        ([2, 5, 10, 20], [2, 5, 10, 20], [100, 110, 120, 150], [0, 0, 0.02, 0], 5, 10, ("errors",)),
        # the lowest rate already fails: the knee lies below it
        ([1, 5, 10, 20], [2, 5, 10, 20], [100, 110, 120, 150], [0, 0, 0, 0], None, 2, ("achieved_below_offered",)),
    ],
)
def test_find_open_knee(achieved, arrived, p99, errors, knee, broke_at, reasons):
    found = find_open_knee([2, 5, 10, 20], achieved, arrived, p99, errors)
    assert (found.rate, found.broke_at, found.reasons) == (knee, broke_at, reasons)


def test_open_knee_rejects_unsorted_rates_and_handles_no_latency():
    with pytest.raises(ValueError):
        find_open_knee([5, 2], [5, 2], [5, 2], [1, 1], [0, 0])
    assert find_open_knee([2, 5], [2, 0], [2, 5], [100, None], [0, 1]).reasons == ("p99_tripled", "achieved_below_offered",
                                                                                     "errors")


def test_synthetic_sweeps_have_knees_in_chapter_order():
    knees = {c: open_knee_of(synthetic_open_loop(c)).rate for c in ("ch01", "ch06")}
    assert knees["ch01"] < knees["ch06"]


# ---------------------------------------------------------------- the report at the same load


def test_same_load_and_same_rate_tables(tmp_path: Path):
    write_synthetic_reference(tmp_path)
    closed, sweeps = load_results(tmp_path), load_open_loop_results(tmp_path)
    assert common_levels(closed) == [1, 8, 32, 64]
    rows = {line.split(" | ")[0].strip("| "): line for line in render_same_load(closed) if line.startswith("| ch")}
    ch03 = sorted(closed["ch03"].levels, key=lambda level: level.users)
    assert rows["ch03"] == "| ch03 | " + " | ".join(
        f"{lvl.latency_ms.p50:,.0f} / {lvl.latency_ms.p99:,.0f}" for lvl in ch03) + " |"
    assert "ch01-workers" not in rows  # variants are not chapters
    # ch01/ch02 stop at 40/s in the synthetic sweeps, the others go further: the common rates end at 40/s
    assert common_rates(sweeps) == [2.0, 5.0, 10.0, 20.0, 40.0]
    table = "\n".join(render_open_loop(sweeps))
    assert "| ch01 | 10/s | 20/s |" in table and "At the same offered rate:" in table
    files = write_report(tmp_path)
    assert files.open_loop_png is not None and files.open_loop_png.stat().st_size > 0


def test_calibration_beside_the_reference(tmp_path: Path):
    here, reference = tmp_path / "results" / "cpu", tmp_path / "reference" / "cpu"
    save_result(rich_synthetic_result("ch01", calibration_scale=0.5), here)
    save_result(synthetic_result("ch01", [SyntheticLevel(1, 10, 50, 60)]), reference)  # no calibration
    closed = load_results(here)
    text = "\n".join(calibration_report(here, closed, {}, reference_root=tmp_path / "reference"))
    assert "| these results | 5.0 | 30.0 | 2.5 | 20.0 | 9.0 | 25.0 |" in text
    assert "the reference holds no calibration" in text
    save_result(rich_synthetic_result("ch02", calibration_scale=1.0), reference)
    text = "\n".join(calibration_report(here, closed, {}, reference_root=tmp_path / "reference"))
    assert "| reference (benchmarks/reference/cpu) | 10.0 | 60.0 |" in text
    assert "0.50-0.50× the reference's speed" in text
    # the reference itself is not compared with itself
    assert "reference (" not in "\n".join(calibration_report(reference, load_results(reference), {},
                                                             reference_root=tmp_path / "reference"))


def test_combined_gflops_is_total_work_over_total_time():
    rates = [MatmulRate(name="a", rows=1, in_features=10, out_features=10, fp32_gflops=1.0, bf16_gflops=None),
             MatmulRate(name="b", rows=1, in_features=10, out_features=30, fp32_gflops=3.0, bf16_gflops=2.0)]
    # a: 200 FLOPs at 1 GFLOP/s = 200 ns; b: 600 FLOPs at 3 GFLOP/s = 200 ns; 800 FLOPs / 400 ns = 2 GFLOP/s
    assert combined_gflops(rates, "fp32_gflops") == {"1": pytest.approx(2.0)}
    assert combined_gflops(rates, "bf16_gflops") == {"1": None}  # one shape without a figure: no total
    assert model_flags(["--weights=dummy", "--preset=gpt2", "--device=cuda", "--torch-threads=1", "--x=y"]) == {
        "weights": "dummy", "preset": "gpt2", "device": "cuda", "torch_threads": 1}


def test_calibration_measures_this_machine():
    from benchmarks.harness.calibration import calibrate

    calibration = calibrate(weights="dummy", preset="tiny", device="cpu", torch_threads=1)
    assert set(calibration.fp32_gflops) == {"1", "64"} and all(v > 0 for v in calibration.fp32_gflops.values())
    assert set(calibration.engine_rps) == {"1", "64"} and all(v > 0 for v in calibration.engine_rps.values())
    assert len(calibration.matmuls) == 10 and calibration.error is None
    assert calibration.bf16_note is not None or all(v is not None for v in calibration.bf16_gflops.values())


# ---------------------------------------------------------------- padding (the chapter 3 notebook)


def test_expected_padding_by_hand():
    # batch of 1: nothing padded
    assert expected_padding({"1": 5}, [16, 32]) == (pytest.approx(5 * 24), pytest.approx(5 * 24))
    # batch of 2 from {16, 32}: the longest is 32 unless both are 16 (1/4): E = 16/4 + 32 x 3/4 = 28
    computed, needed = expected_padding({"2": 1}, [16, 32])
    assert (computed, needed) == (pytest.approx(56), pytest.approx(48))


# ---------------------------------------------------------------- the open loop for real (instant server)


def test_open_loop_against_the_instant_server(tmp_path: Path):
    from benchmarks.harness.loadgen import OpenLevelPlan, run_open_level
    from benchmarks.harness.server_process import running_module
    from benchmarks.harness.workload import get_workload

    plan = OpenLevelPlan(rate=40.0, lead_in_s=0.5, window_s=2.0, drain_s=5.0, max_outstanding=32, slo_ms=1000.0,
                         workload=get_workload("default"), seed=1234, vocab_size=258, request_timeout_s=10.0)
    with running_module("benchmarks.harness.trivial_server", name="instant") as server:
        level = run_open_level(server.url, plan, server_pid=server.pid, loadgen_cores=None, work_dir=tmp_path)
    # 80 arrivals expected; a Poisson count lies within 5 standard deviations (about 45) of it
    assert 35 <= level.arrivals <= 125
    assert level.requests_failed == 0 and level.dropped == 0 and level.unfinished == 0
    assert level.requests_ok == level.arrivals and level.goodput_rps == pytest.approx(level.arrivals / 2.0)
    assert level.server_series is None and level.resource_series
    assert level.max_outstanding_seen <= 32


# ---------------------------------------------------------------- what the server chose


@contextlib.contextmanager
def _stats_server(body: object, status: int = 200):
    """A loopback HTTP server whose ``GET /stats`` answers ``body`` as JSON with ``status``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            payload = json.dumps(body).encode()
            self.send_response(status if self.path == "/stats" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_server_choices_keep_what_the_start_up_rules_chose_and_nothing_else():
    # /stats as chapter 8 writes it: chapter 5's engine description, the attention backend, the scheduler
    stats = {"engine": {"engine": "eager", "precision": "fp32", "dtype": "float32", "device": "cpu", "conversion": {"seconds": 0.1}},
             "attention": "kernel", "scheduler": {"running": 3, "prefix_cache": {"hit_rate": 0.25}}, "in_flight": 7}
    with _stats_server(stats) as url:
        assert server_choices(url) == {"engine": {"engine": "eager", "precision": "fp32", "dtype": "float32"},
                                       "attention": "kernel", "prefix_cache": {"hit_rate": 0.25}}
    with _stats_server({"engine": {"engine": "eager", "precision": "bf16", "dtype": "bfloat16"}, "batcher": {}}) as url:
        assert server_choices(url) == {"engine": {"engine": "eager", "precision": "bf16", "dtype": "bfloat16"}}  # chapters 5-6
    with _stats_server({"batcher": {"batches": 3}}) as url:
        assert server_choices(url) == {}  # a chapter with no start-up rule
    with _stats_server({"detail": "not found"}, status=404) as url:
        assert server_choices(url) == {}  # no /stats (chapter 1)


def test_a_result_keeps_its_servers_choices_and_older_results_load_without_them(tmp_path: Path):
    result = synthetic_result("ch08", [SyntheticLevel(users=1, qps=10.0, p50_ms=80.0, p99_ms=120.0)])
    assert result.server.choices == {}  # not given: nothing is made up
    chosen = result.model_copy(update={"server": result.server.model_copy(update={"choices": {"engine": {"engine": "eager"}}})})
    path = save_result(chosen, tmp_path)
    assert load_result(path).server.choices == {"engine": {"engine": "eager"}}
    assert load_result(REFERENCE_ROOT / "cpu-previous" / "ch03.json").server.choices == {}
