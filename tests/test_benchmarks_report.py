"""The harness's pure parts on hand-computed inputs: level summaries, the knee, the table, the README blocks.

No server, no Locust, no timing: every expected figure below is worked out by hand in the comments.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from benchmarks.harness.profiles import build_profiles, resolve_profile_name
from benchmarks.harness.results import BenchmarkResult, load_result, load_results, save_result
from benchmarks.harness.summaries import summarize_level
from benchmarks.harness.workload import WORKLOADS, PromptStream, check_response
from benchmarks.report import write_report
from benchmarks.report.knees import find_knee
from benchmarks.report.readme_blocks import (
    block_keys,
    rewrite_blocks,
    split_key,
    update_readmes,
)
from benchmarks.report.reference import save_reference
from benchmarks.report.tables import build_rows, render_table, warnings_for

from synthetic_results import SyntheticLevel, synthetic_result, write_synthetic_climb

# ---------------------------------------------------------------- the level summary


def test_summarize_level_counts_requests_finished_inside_the_window():
    window_start, window_end = 100.0, 110.0
    records = [
        [99.0, 2.0, 200, True, 32, None],  # issued before the window, finished inside it at 101: 2000 ms
        [101.0, 1.0, 200, True, 32, None],  # 1000 ms
        [102.0, 2.0, 200, True, 32, None],  # 2000 ms
        [103.0, 3.0, 200, True, 32, None],  # 3000 ms
        [104.0, 0.5, 429, False, 0, "HTTP 429"],
        [105.0, 0.1, 0, False, 0, "HTTP 0"],
        [109.5, 1.0, 200, True, 32, None],  # finished at 110.5, after the window: not counted at all
    ]
    level = summarize_level(records, window_start, window_end, users=4, stopped_by="time_limit", locust_exit_code=0)
    assert level.requests_ok == 4 and level.requests_failed == 2
    assert level.qps == pytest.approx(4 / 10)
    assert level.tokens_per_s == pytest.approx(4 * 32 / 10)
    assert level.latency_sample == 4
    # numpy's linear percentile over the sorted [1000, 2000, 2000, 3000]: value at rank q/100 * 3
    assert level.latency_ms.p50 == pytest.approx(2000)  # rank 1.5: between 2000 and 2000
    assert level.latency_ms.p90 == pytest.approx(2700)  # rank 2.7: 2000 + 0.7 x 1000
    assert level.latency_ms.p99 == pytest.approx(2970)  # rank 2.97
    assert level.latency_ms.max == pytest.approx(3000)
    assert level.latency_ms.mean == pytest.approx(2000)
    assert level.errors_by_status == {"0": 1, "429": 1}
    assert level.failure_reasons == {"HTTP 429": 1, "HTTP 0": 1}


def test_summarize_level_without_successes_has_no_latency():
    level = summarize_level([[1.0, 0.1, 503, False, 0, "HTTP 503"]], 0.0, 2.0, users=1, stopped_by="time_limit",
                            locust_exit_code=0)
    assert level.qps == 0 and level.latency_ms is None and level.errors_by_status == {"503": 1}


# ---------------------------------------------------------------- the knee


@pytest.mark.parametrize(
    ("qps", "knee_users", "reasons"),
    [
        # best 21: 20 at one user is already 95 % of it; more users only wait
        ([20, 21, 21, 20], 1, ("saturated",)),
        # best 100: 95 at 32 users reaches 90 %, 64 adds little
        ([10, 50, 95, 100], 32, ("saturated",)),
        # exactly 90 % of the best counts as reached
        ([10, 45, 50, 50], 8, ("saturated",)),
        # QPS still climbing at the highest load: saturation lies beyond 64
        ([10, 20, 40, 80], 64, ()),
        # a peak in the middle: the knee is the first load within 90 % of it, not the peak
        ([10, 91, 100, 60], 8, ("saturated",)),
    ],
)
def test_find_knee(qps, knee_users, reasons):
    knee = find_knee([1, 8, 32, 64], qps)
    assert knee.users == knee_users
    assert knee.reasons == reasons
    assert knee.reached == bool(reasons)


def test_find_knee_single_level_and_unsorted_levels():
    assert find_knee([4], [10.0]).users == 4
    with pytest.raises(ValueError):
        find_knee([8, 1], [1, 2])


# ---------------------------------------------------------------- the table


def _climb() -> dict[str, BenchmarkResult]:
    return {
        "ch01": synthetic_result("ch01", [SyntheticLevel(1, 20, 50, 60), SyntheticLevel(8, 21, 380, 420),
                                          SyntheticLevel(32, 21, 1500, 1600), SyntheticLevel(64, 20, 3000, 3300)]),
        "ch02": synthetic_result("ch02", [SyntheticLevel(1, 22, 45, 55), SyntheticLevel(8, 25, 320, 360),
                                          SyntheticLevel(32, 25, 1280, 1350),
                                          SyntheticLevel(64, 25, 2560, 2700, errors_by_status={"429": 3})]),
    }


def test_build_rows_takes_figures_at_the_highest_qps_level():
    rows = {row.label: row for row in build_rows(_climb(), ["ch01", "ch02", "ch03"], {"ch03": "not built yet"})}
    # ch01: highest QPS 21, first reached at 8 users
    assert (rows["ch01"].users, rows["ch01"].qps, rows["ch01"].p50_ms, rows["ch01"].p99_ms) == (8, 21, 380, 420)
    assert rows["ch01"].ratio_to_baseline == pytest.approx(1.0)
    # ch02: 25 QPS at 8 users, 25 x 32 tokens; 25 / 21 of ch01; errors summed over every level
    assert (rows["ch02"].users, rows["ch02"].qps, rows["ch02"].tokens_per_s) == (8, 25, 800)
    assert rows["ch02"].ratio_to_baseline == pytest.approx(25 / 21)
    assert rows["ch02"].errors == 3 and rows["ch02"].errors_by_status == (("429", 3),)
    assert (rows["ch02"].article_qps, rows["ch02"].article_p99_ms) == (28, 1800)
    assert rows["ch02"].article_ratio == pytest.approx(28 / 12)
    # ch02 saturates at 8 users: 25 is its best, 22 at one user is under 90 % of it
    assert rows["ch02"].knee_users == 8 and rows["ch02"].knee_reached
    # a missing chapter keeps the article's figures and says why it has none
    assert not rows["ch03"].measured and rows["ch03"].note == "not built yet" and rows["ch03"].article_qps == 95


def test_render_table_rows():
    table = render_table(_climb(), ["ch01", "ch02", "ch03"], {"ch03": "not built yet"})
    # QPS at the best level (8 users for both); P50/P99 at the top load, the 64-user level of each
    # (3,000/3,300 and 2,560/2,700 ms), the same load for both, never each one's best level (380/420 for ch01)
    # saturation: ch01 reaches 90 % of its best (21) at one user (20); ch02 (best 25) at 8 users
    assert "| ch01 | 21.0 | 672 | 8 | 3,000 | 3,300 | 64 | 1 | 0 | 1.00× | 12 | 3,500 | 1.00× |" in table
    assert "| ch02 | 25.0 | 800 | 8 | 2,560 | 2,700 | 64 | 8 | 3 (429: 3) | 1.19× | 28 | 1,800 | 2.33× |" in table
    assert "| ch03 | *not built yet* | — | — | — | — | — | — | — | — | 95 | 600 | 7.92× |" in table


def test_table_without_baseline_has_no_ratio_and_lists_variants():
    results = {
        "ch02": _climb()["ch02"],
        "ch02-wide": synthetic_result("ch02", [SyntheticLevel(1, 50, 10, 20)], label="ch02-wide"),
    }
    table = render_table(results, ["ch01", "ch02"], {"ch01": "not built yet"})
    assert "| ch02 | 25.0 | 800 | 8 | 2,560 | 2,700 | 64 | 8 | 3 (429: 3) | — |" in table
    assert "| ch02-wide | ch02 | 50.0 | 10 | 20 | 1 | 0 | 2.00× |" in table  # 50 / 25 of its own chapter


def test_warnings_name_chapters_whose_top_loads_differ():
    results = {**_climb(), "ch03": synthetic_result("ch03", [SyntheticLevel(1, 20, 50, 60), SyntheticLevel(32, 40, 800, 900)])}
    assert any("top loads differ (ch01 64, ch02 64, ch03 32)" in w for w in warnings_for(results))
    assert not any("top loads" in w for w in warnings_for(_climb()))


def test_warnings_name_a_busy_load_generator_and_small_samples():
    busy = synthetic_result("ch03", [SyntheticLevel(64, 900, 10, 20, loadgen_cpu_percent=93, latency_sample=150)])
    warnings = " ".join(warnings_for({"ch03": busy}))
    assert "ch03 at 64 users: the load generator used 93 %" in warnings
    assert "fewer than 200 requests measured at concurrency 64" in warnings
    assert warnings_for(_climb()) == []


def test_report_with_missing_chapters(tmp_path: Path):
    save_result(_climb()["ch02"], tmp_path)  # only ch02: ch01 (the baseline) and ch03..ch06 are missing
    files = write_report(tmp_path)
    assert files.climb_png.stat().st_size > 0 and files.latency_png.stat().st_size > 0
    lines = files.table.read_text().splitlines()
    ch01 = next(line for line in lines if line.startswith("| ch01 |"))
    assert "*not " in ch01  # "not built yet" or "not measured", depending on the registry
    assert all(any(line.startswith(f"| {c} | *not ") for line in lines) for c in ("ch04", "ch05", "ch06"))
    assert "| ch02 | 25.0 |" in files.table.read_text()


def test_report_of_an_empty_directory(tmp_path: Path):
    files = write_report(tmp_path)
    assert files.climb_png.exists() and "| ch01 | *not " in files.markdown


# ---------------------------------------------------------------- the results schema


def test_results_round_trip_and_reject_unknown_fields(tmp_path: Path):
    result = _climb()["ch01"]
    path = save_result(result, tmp_path)
    assert path.name == "ch01.json"
    assert load_result(path) == result
    long = synthetic_result("ch04", [SyntheticLevel(1, 2, 400, 450)], workload="long", max_new_tokens=256)
    assert save_result(long, tmp_path).name == "ch04-long.json"
    assert set(load_results(tmp_path)) == {"ch01"} and set(load_results(tmp_path, "long")) == {"ch04"}
    with pytest.raises(ValidationError):
        BenchmarkResult.model_validate({**result.model_dump(), "surprise": 1})


# ---------------------------------------------------------------- the README blocks


def test_rewrite_blocks_replaces_only_between_markers():
    text = "intro\n<!-- results:ch02 -->\nold figures\n<!-- /results -->\nmiddle\n<!-- results:climb --><!-- /results -->\nend\n"
    rewritten = rewrite_blocks(text, lambda key: f"NEW {key}")
    assert rewritten == (
        "intro\n<!-- results:ch02 -->\nNEW ch02\n<!-- /results -->\nmiddle\n<!-- results:climb -->\nNEW climb\n"
        "<!-- /results -->\nend\n"
    )
    assert block_keys(text) == ["ch02", "climb"]
    assert rewrite_blocks(rewritten, lambda key: f"NEW {key}") == rewritten  # idempotent


def test_update_readmes_from_reference_results(tmp_path: Path):
    reference = tmp_path / "reference" / "cpu"
    write_synthetic_climb(reference)
    write_report(reference)
    readme = tmp_path / "chapters" / "ch02_fastapi_async" / "README.md"
    readme.parent.mkdir(parents=True)
    readme.write_text(
        "# ch02\n\n<!-- results:ch02 -->\n<!-- /results -->\n\n<!-- results:ch01-workers -->\n<!-- /results -->\n\n"
        "<!-- results:ch09 -->\n<!-- /results -->\n\n<!-- results:climb -->\n<!-- /results -->\nthe end\n"
    )
    assert update_readmes([readme], profile="cpu", directory=reference) == [readme]
    text = readme.read_text()
    assert text.startswith("# ch02\n\n<!-- results:ch02 -->\n") and text.endswith("<!-- /results -->\nthe end\n")
    ch02 = text.split("<!-- results:ch02 -->")[1].split("<!-- /results -->")[0]
    # write_synthetic_climb: ch01 peaks at 21 QPS (8 users), ch02 at 25 QPS (8 users): 25 / 21 = 1.19
    # QPS and tokens/s at saturation (8 users); P50/P99 at the top load (64 users) for both runs
    assert "| ch01 | 21.0 | 672 | 8 | 3,000 | 3,300 | 64 | 0 |" in ch02
    assert "| **ch02** | 25.0 | 800 | 8 | 2,560 | 2,700 | 64 | 0 |" in ch02
    assert "| ch02 / ch01 | 1.19× | 1.19× |  | 0.85× | 0.82× |" in ch02  # 2560/3000, 2700/3300
    assert "`python -m benchmarks run --chapter ch02 --profile cpu`" in ch02
    assert "ch02.json" in ch02
    workers = text.split("<!-- results:ch01-workers -->")[1].split("<!-- /results -->")[0]
    assert "| ch01-workers / ch01 | 0.95× |" in workers  # 20 / 21 QPS against its own chapter
    assert "No reference result for `ch09`" in text
    climb = text.split("<!-- results:climb -->")[1].split("<!-- /results -->")[0]
    assert "| ch02 | 25.0 |" in climb and "climb.png" in climb
    assert update_readmes([readme], profile="cpu", directory=reference) == []  # nothing left to change


def test_every_block_the_renderer_knows_by_name_has_a_place_in_a_readme():
    """A block deleted with the text around it (it happened once: a whole lesson went with it) leaves
    its renderer unused; every name ``render_key`` answers must still be placed in some README."""
    import inspect

    from benchmarks.report import readme_blocks

    source = inspect.getsource(readme_blocks.render_key)
    named = set(re.findall(r'key == "([^"]+)"', source))
    named |= {f"{chapter}-live-page-cost" for chapter in ("ch03", "ch08")}  # the suffix rule's two pages
    placed = {key for readme in readme_blocks.default_readmes() for key in block_keys(readme.read_text())}
    assert named and named <= placed, f"blocks no README places any more: {sorted(named - placed)}"


def test_the_decode_attention_block_shows_every_candidate_and_the_compiled_step(tmp_path: Path):
    from benchmarks.report.study_blocks import decode_attention_block

    timing = lambda ms: {"min_ms": ms, "median_ms": ms * 1.5}  # noqa: E731
    run = {"workload": "default", "rounds": 3, "torch": "2.x", "cpu": "a CPU", "command": "python -m benchmarks.studies.decode_attention.decode_attention",
           "attention": {"engine": "eager/bf16", "kv_cache_dtype": "bfloat16", "rows": 64, "block_tokens": 16,
                         "context_median": 53, "context_max": 155, "bytes_read_mb": 4.5, "dense_cache_bytes_mb": 12.0,
                         "per_layer": {"flex": timing(2.5), "flex kernel": timing(1.5), "dense cache": timing(2.0),
                                       "kernel call": timing(0.6)},
                         "gb_per_s_at_min": {"flex": 1.8, "flex kernel": 3.0, "dense cache": 2.2, "kernel call": 7.5}},
           "step_without_attention": {"64": {"eager": timing(8.0), "compiled": timing(10.0)}}}
    (tmp_path / "ch08").mkdir()
    (tmp_path / "ch08" / "decode-attention-default.json").write_text(json.dumps(run))
    text = decode_attention_block(tmp_path)
    assert "| default | 64 | 16 | 53 / 155 | 4.5 | 2.50 (1.8 GB/s) | 1.50 (3.0 GB/s) | 2.00 (2.2 GB/s) | 0.60 (7.5 GB/s) |" in text
    # dense: 12 MB in 2 ms = 6 GB/s; the step's 4.5 MB at 6 GB/s = 0.75 ms; the kernel's 1.5 ms / 0.75 = 2.0x
    assert "at 6.0 GB/s" in text and "would take 0.75 ms, against 1.50 ms" in text and "**2.0×**" in text
    assert "included, took 0.60 ms: **2.5×** faster" in text  # 1.5 / 0.6
    assert "| default | 64 | 8.00 | 10.00 | 1.25× |" in text  # 10 / 8
    assert "`python -m benchmarks.studies.decode_attention.decode_attention`" in text
    assert "No measurement yet" in decode_attention_block(tmp_path / "elsewhere")


def test_a_decode_attention_folder_is_its_own_block(tmp_path: Path):
    from benchmarks.report.study_blocks import decode_attention_block

    timing = {"min_ms": 2.0, "median_ms": 3.0}
    candidates = ("dense cache", "flex kernel", "kernel call")
    run = {"workload": "mixed", "rounds": 3, "torch": "2.x", "cpu": "another CPU", "command": "python -m benchmarks.studies.decode_attention.decode_attention",
           "attention": {"engine": "eager/fp32", "kv_cache_dtype": "float32", "rows": 64, "block_tokens": 16,
                         "context_median": 98, "context_max": 305, "bytes_read_mb": 13.7, "dense_cache_bytes_mb": 20.0,
                         "per_layer": {name: timing for name in candidates}, "gb_per_s_at_min": {name: 6.9 for name in candidates}},
           "step_without_attention": None}
    (tmp_path / "ch08" / "decode-attention-avx2").mkdir(parents=True)
    (tmp_path / "ch08" / "decode-attention-avx2" / "mixed.json").write_text(json.dumps(run))
    text = decode_attention_block(tmp_path, "decode-attention-avx2")
    assert "| mixed | 64 | 16 | 98 / 305 | 13.7 | 2.00 (6.9 GB/s) | 2.00 (6.9 GB/s) | 2.00 (6.9 GB/s) |" in text and "another CPU" in text
    assert "eager and under `torch.compile`" not in text  # the run did not measure the rest of the step
    assert "No measurement yet" in decode_attention_block(tmp_path)  # the folder is not the first machine's files


def test_the_event_loop_block_shows_each_trees_medians(tmp_path: Path):
    from benchmarks.report.study_blocks import event_loop_block

    def tree(label: str, share: float, streamed: bool = False) -> dict:
        return {"label": label, "commit": label[:3] + "1234567", "streamed": streamed, "server_args": "",
                "median": {"qps": 50.0, "p99_ms": 1500.0, "requests": 1000, "event_loop_share": share, "step_share": 1 - share,
                           "event_loop_ms_per_request": share * 20}, "runs": []}

    run = {"kind": "event-loop-share", "command": "python thread_share.py --trees a b", "workload": "default", "users": 64,
           "duration_s": 20.0, "streamed": False, "rounds": 3, "cpu": "a CPU", "trees": [tree("polling", 0.15), tree("waiting", 0.075)]}
    folder = tmp_path / "event_loop"
    assert "No rounds yet" in event_loop_block(folder)
    folder.mkdir(parents=True)
    (folder / "default-whole.json").write_text(json.dumps(run))
    text = event_loop_block(folder)
    assert "| default | whole | 64 | 3 | polling (`pol1234567`) | 50.0 | 1,500 | 15.0% | — | 3.00 |" in text
    assert "| default | whole | 64 | 3 | waiting (`wai1234567`) | 50.0 | 1,500 | 7.5% | — | 1.50 |" in text
    assert "`python thread_share.py --trees a b`" in text and "a CPU" in text
    # A run with --both: one tree streamed and whole, each row saying which.
    both = {**run, "command": "python thread_share.py --trees a --both", "workload": "mixed", "streamed": None,
            "trees": [tree("head", 0.12, streamed=True), tree("head", 0.05)]}
    (folder / "mixed-both.json").write_text(json.dumps(both))
    text = event_loop_block(folder)
    assert "| mixed | streamed | 64 | 3 | head (`hea1234567`) | 50.0 | 1,500 | 12.0% | — | 2.40 |" in text
    assert "| mixed | whole | 64 | 3 | head (`hea1234567`) | 50.0 | 1,500 | 5.0% | — | 1.00 |" in text
    # A tree run with flags of its own, and the loop's kernel time split out.
    flagged = {**both, "trees": [{**tree("head", 0.12, streamed=True), "server_args": "--stream-interval=16",
                                  "median": {**tree("head", 0.12)["median"], "event_loop_kernel_share": 0.03}}]}
    (folder / "mixed-flagged.json").write_text(json.dumps(flagged))
    text = event_loop_block(folder)
    assert "| mixed | streamed | 64 | 3 | head (`hea1234567`) `--stream-interval=16` | 50.0 | 1,500 | 12.0% | 3.0% | 2.40 |" in text


def test_a_side_by_side_folder_shows_each_variant_against_chapter_6(tmp_path: Path):
    from benchmarks.report.streaming_blocks import side_by_side_block

    def figures(qps: float, p99: float) -> dict:
        return {"qps": qps, "e2e_ms": {"p99": p99}, "ttft_ms": {"p99": 100.0}, "errors": {}}

    folder = tmp_path / "ch08" / "side-by-side-x"
    folder.mkdir(parents=True)
    for index, (variant_qps, variant_p99) in enumerate(((30.0, 500.0), (40.0, 700.0), (35.0, 600.0))):
        run = {"workload": "mixed", "users": 64, "command": f"compare round {index}", "harness": None,
               "variants": {"ch06": {"chapter": "ch06", "flags": ""}, "ch08": {"chapter": "ch08", "flags": ""},
                            "ch08-kv": {"chapter": "ch08", "flags": "--kv-cache-dtype=bf16"}},
               "chapters": {"ch06": figures(10.0, 1000.0), "ch08": figures(25.0, 800.0), "ch08-kv": figures(variant_qps, variant_p99)}}
        (folder / f"round{index}.json").write_text(json.dumps(run))
    text = side_by_side_block(tmp_path, "side-by-side-x")
    assert "| mixed | 64 | 3 | 10.0 | 25.0 | 2.50× | 1,000 | 800 | 0.80× | 100 | 0 |" in text
    # the variant: medians 35 QPS and 600 ms over chapter 6's 10 and 1,000
    assert "`ch08-kv`: chapter 8 with `--kv-cache-dtype=bf16`" in text
    assert "| mixed | 64 | 3 | 10.0 | 35.0 | 3.50× | 1,000 | 600 | 0.60× | 100 | 0 |" in text


def test_the_targets_block_reads_each_target_against_its_rounds_and_says_which_are_met(tmp_path: Path):
    from benchmarks.report.streaming_blocks import CH08_TARGET_CLIMB, CH08_TARGET_PROFILES, ch08_targets_block

    def figures(qps: float, p99: float, ttft: float = 100.0) -> dict:
        return {"qps": qps, "e2e_ms": {"p99": p99}, "ttft_ms": {"p99": ttft}, "errors": {}, "engine": {"precision": "fp32"}}

    folder = tmp_path / "ch08" / "side-by-side-avx2-streamed-collector"
    folder.mkdir(parents=True)
    # chapter 6 at 10/20/40 QPS, chapter 8 at 12/26/44: medians 20 and 26, 1.30x, exactly the bound, though the rounds'
    # own ratios (1.20/1.30/1.10) have a median of 1.20: the figure is the tables' ratio of the medians.
    # P99: chapter 6 at 1,000 every round, chapter 8 at 700/800/1,100: median 800 over 1,000, 0.80x, over mixed's 0.75.
    for index, (base, ours, p99) in enumerate(((10.0, 12.0, 700.0), (20.0, 26.0, 800.0), (40.0, 44.0, 1100.0))):
        for workload in ("default", "mixed"):
            run = {"workload": workload, "users": 64, "harness": {"git_commit": "ab" * 20, "cpu": "Some CPU"},
                   "chapters": {"ch06": figures(base, 1000.0), "ch08": figures(ours, p99)}}
            (folder / f"{workload}-round{index}.json").write_text(json.dumps(run))
    (tmp_path / "ch08" / CH08_TARGET_PROFILES[0][1]).write_text(
        "median step 20.00 ms: ...; running 64, tokens per step 64\nschedule + prepare + update = 16.2% of the median step\n")
    save_result(synthetic_result("ch06", [SyntheticLevel(64, 40, 900, 1000)]), tmp_path / CH08_TARGET_CLIMB)
    save_result(synthetic_result("ch08", [SyntheticLevel(64, 50, 700, 800)]), tmp_path / CH08_TARGET_CLIMB)
    text = ch08_targets_block(tmp_path)
    rows = {tuple(cell.strip() for cell in line.split("|")[1:5]): line for line in text.splitlines() if line.startswith("| ")}
    streamed = "`side-by-side-avx2-streamed-collector/` (streamed)"
    qps = rows["QPS, chapter 8 over chapter 6", "default", "64", streamed]
    assert "| `abababa` | 3 | 1.30× | 1.20× / 1.30× / 1.10× | >= 1.30× | yes |" in qps
    assert "| 0.80× | 0.70× / 0.80× / 1.10× | <= 1.00× | yes |" in rows["P99, chapter 8 over chapter 6", "default", "64", streamed]
    assert rows["P99, chapter 8 over chapter 6", "mixed", "64", streamed].endswith("| <= 0.75× | **no** |")
    assert rows["QPS, chapter 8 over chapter 6", "mixed", "64", streamed].endswith("| >= 4.00× | **no** |")
    # the folders not written, and the second profile, say so instead of a figure
    whole = rows["QPS, chapter 8 over chapter 6", "default", "64", "`side-by-side-avx2-waiting-no-stream/` (whole answers)"]
    assert "| 0 | not measured |" in whole
    assert "| 64 running |" in text and "| 16.2% | — | <= 15% | **no** |" in text
    assert sum("schedule + prepare + update" in line and "not measured" in line for line in rows.values()) == 1
    assert "over the best other chapter's (ch06) | default | best level |" in text and "| 1.25× | — | > 1.00× | yes |" in text
    # the climb also measures the default target: 50 QPS over 40 is short of 1.3x; P99 at 64 users 800 over 1,000
    climb = "`climb-avx2/` (Locust, whole answers)"
    assert rows["QPS, chapter 8 over chapter 6", "default", "best level (ch06 64, ch08 64)", climb].endswith(
        "| 1.25× | — | >= 1.30× | **no** |")
    assert rows["P99, chapter 8 over chapter 6", "default", "64", climb].endswith("| 0.80× | — | <= 1.00× | yes |")
    assert "vLLM's CPU backend" in text and "Where they ran: `side-by-side-avx2-streamed-collector/` on Some CPU (chapter 6 fp32, chapter 8 fp32)." in text


def test_the_stream_interval_block_shows_each_setting_against_chapter_6_with_its_token_gaps(tmp_path: Path):
    from benchmarks.report.streaming_blocks import STREAM_INTERVAL_DIR, stream_interval_block

    def figures(qps: float, itl: tuple[float, float] | None) -> dict:
        return {"qps": qps, "e2e_ms": {"p99": 1000.0 / qps * 10}, "ttft_ms": {"p99": 100.0}, "errors": {},
                "itl_ms": {"p50": itl[0], "p99": itl[1]} if itl else None}

    assert "No rounds yet" in stream_interval_block(tmp_path)
    folder = tmp_path / "ch08" / STREAM_INTERVAL_DIR
    folder.mkdir(parents=True)
    for index, interval_qps in enumerate((12.0, 16.0, 14.0)):
        run = {"workload": "mixed", "users": 64, "command": f"compare round {index}", "harness": None,
               "variants": {"ch06": {"chapter": "ch06", "flags": ""}, "ch08": {"chapter": "ch08", "flags": ""},
                            "ch08-interval4": {"chapter": "ch08", "flags": "--stream-interval=4"}},
               "chapters": {"ch06": figures(5.0, None), "ch08": figures(10.0, (30.0, 60.0)),
                            "ch08-interval4": figures(interval_qps, (0.0, 120.0 + index))}}
        (folder / f"mixed-64-round{index}.json").write_text(json.dumps(run))
    text = stream_interval_block(tmp_path)
    assert "| mixed | 64 | 3 | ch06 | — (whole answers) | 5.0 | 1.00× | 2,000 | 1.00× | 100 | — | 0 |" in text
    assert "| mixed | 64 | 3 | ch08 | 1 | 10.0 | 2.00× | 1,000 | 0.50× | 100 | 30 / 60 | 0 |" in text
    # the variant's medians: 14 QPS (714 ms P99), ITL P99 121 ms
    assert "| mixed | 64 | 3 | ch08-interval4 | 4 | 14.0 | 2.80× | 714 | 0.36× | 100 | 0 / 121 | 0 |" in text
    assert "`compare round 0`" in text


def test_the_serve_path_cost_block_divides_each_processes_cores_by_the_answers_and_compares_like_runs(tmp_path: Path):
    from benchmarks.report.scale_out_blocks import serve_path_cost_block

    assert "No comparison yet" in serve_path_cost_block(tmp_path, "default")

    def config(qps: float, tokens_per_s: float, cores: dict) -> dict:
        return {"median": {"qps": qps, "output_tokens_per_s": tokens_per_s, "server_cores_busy": cores}}

    run = {"configs": {
        "chapter 8 alone": config(100.0, 3200.0, {"server": 1.0}),
        "1 replica": config(50.0, 1600.0, {"replicas": 0.9, "Serve's proxy": 0.4, "Serve's controller": 0.05, "Ray's other processes": 0.05, "server": 0.0}),
        "chapter 8 alone, runs of 64": config(125.0, 4000.0, {"server": 1.0}),
        "1 replica, runs of 64": config(80.0, 2560.0, {"replicas": 0.96, "Serve's proxy": 0.32, "Ray's other processes": 0.0}),
    }}
    (tmp_path / "ch09").mkdir()
    (tmp_path / "ch09" / "serve-path-default.json").write_text(json.dumps(run))
    text = serve_path_cost_block(tmp_path, "default")
    assert "| chapter 8 alone | 32 | 10.0 | 0.0 | 0.0 | 10.0 | 1.00× |" in text
    # 0.9 / 50 s of a core per answer in the replica, 0.4 / 50 in the proxy, 0.1 / 50 in the rest: 28 ms against 10
    assert "| 1 replica | 32 | 18.0 | 8.0 | 2.0 | 28.0 | 2.80× |" in text
    # against chapter 8 alone with the same runs (8 ms), not against the first row
    assert "| 1 replica, runs of 64 | 32 | 12.0 | 4.0 | 0.0 | 16.0 | 2.00× |" in text


def test_the_step_profile_table_reads_each_files_first_line(tmp_path: Path):
    from benchmarks.report.study_blocks import packed_step_profile_block

    folder = tmp_path / "ch08"
    folder.mkdir()
    rest = ("152 requests in 5.2 s = 29.2 req/s (4076 tokens computed/s) without a profiler\n"
            "median step 23.26 ms: schedule 0.20 ms (1%), prepare 0.52 ms (2%), model 22.14 ms (95%), update 0.40 ms (2%)\n"
            "schedule + prepare + update = 4.8% of the median step\nCPU: AMD EPYC, AVX2\n"
            "   ncalls  tottime  percall  blocks of 99, (a line of cProfile's report, not the header)\n")
    (folder / "profile-new.txt").write_text(
        "attention kernel, engine eager/fp32, KV cache float32, workload mixed, blocks of 128, 64 sequences, greedy\n" + rest)
    (folder / "profile-smollm2.txt").write_text(
        "smollm2: attention flex, engine eager/bf16, KV cache bfloat16, workload default, blocks of 16, 64 sequences, greedy\n"
        + rest.replace("CPU: AMD EPYC, AVX2\n", ""))
    text = packed_step_profile_block(tmp_path)
    assert "| `profile-new.txt` | kernel | eager/fp32 | float32 | 128 | mixed | 29.2 | 23.26 | 95 % | 4.8% | AMD EPYC, AVX2 |" in text
    assert "| `profile-smollm2.txt` | flex | eager/bf16 | bfloat16 | 16 | default | 29.2 | 23.26 | 95 % | 4.8% | not recorded |" in text


def test_a_partial_climb_shows_its_chapters_and_the_last_ones_ratios(tmp_path: Path):
    from benchmarks.report.climb_blocks import partial_climb_block

    write_synthetic_climb(tmp_path)
    text = partial_climb_block(tmp_path, "`the command`", tmp_path / "README.md")
    assert "| ch02 | 25.0 |" in text and "| ch03 |" not in text  # the chapters measured, no others
    # ch02 peaks at 25 QPS, ch01 at 21: 1.19; P99 at 64 users 2,700 against 3,300: 0.82; the variant is left out
    assert "ch02 / ch01: QPS **1.19×**, P99 at 64 users 0.82×." in text and "ch01-workers /" not in text
    assert "Reproduce: `the command`." in text
    assert "No results yet" in partial_climb_block(tmp_path / "elsewhere", "`the command`", tmp_path / "README.md")


def test_block_keys_may_name_their_profile():
    assert split_key("climb@gpu", "cpu") == ("climb", "gpu")
    assert split_key("ch01-workers", "cpu") == ("ch01-workers", "cpu")


def test_save_reference_copies_results_and_redraws_the_report(tmp_path: Path):
    results = tmp_path / "results" / "cpu"
    paths = write_synthetic_climb(results)
    reports = save_reference([paths["ch01"], paths["ch02"]], "cpu", reference_root=tmp_path / "reference")
    reference = tmp_path / "reference" / "cpu"
    assert sorted(p.name for p in reference.glob("*.json")) == ["ch01.json", "ch02.json"]
    assert [r.table for r in reports] == [reference / "climb.md"]
    assert (reference / "climb.png").exists() and (reference / "latency_vs_load.png").exists()
    with pytest.raises(ValueError):
        save_reference([paths["ch01"]], "gpu", reference_root=tmp_path / "reference")  # a cpu result is no gpu reference


def test_save_reference_refuses_a_result_of_an_uncommitted_tree(tmp_path: Path):
    path = write_synthetic_climb(tmp_path / "results" / "cpu")["ch01"]
    result = load_result(path)
    dirty = result.model_copy(update={"environment": result.environment.model_copy(update={"git_dirty": True})})
    path.write_text(dirty.model_dump_json())
    with pytest.raises(ValueError, match="commit first"):
        save_reference([path], "cpu", reference_root=tmp_path / "reference")
    assert not (tmp_path / "reference" / "cpu" / "ch01.json").exists()
    save_reference([path], "cpu", reference_root=tmp_path / "reference", allow_dirty=True)


def _recorded_commits(value) -> set[str]:
    """Every ``git_commit`` value anywhere in a JSON document."""
    if isinstance(value, dict):
        found = {value["git_commit"]} if isinstance(value.get("git_commit"), str) else set()
        return found.union(*(_recorded_commits(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_recorded_commits(v) for v in value))
    return set()


def test_every_reference_file_names_a_commit_of_this_history():
    """A reader can check out the code a committed figure measured (the synthetic zeros aside)."""
    reference = Path(__file__).resolve().parents[1] / "benchmarks" / "reference"
    missing = {}
    for path in sorted(reference.rglob("*.json")):
        for commit in _recorded_commits(json.loads(path.read_text())) - {"0" * 40}:
            known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=reference, capture_output=True)
            if known.returncode != 0:
                missing.setdefault(commit[:10], []).append(str(path.relative_to(reference)))
    assert not missing, f"reference files name commits that are not in this history: {missing}"


# ---------------------------------------------------------------- profiles and workload


def test_core_plans():
    profiles = build_profiles()
    assert profiles["cpu"].core_plan([0, 1]) == ([0], [1])  # server core 0, Locust core 1
    assert profiles["gpu"].core_plan(list(range(16))) == (list(range(15)), [15])
    assert profiles["cpu"].core_plan([0]) == (None, None)  # one core: nothing to separate
    assert profiles["cpu"].thread_env()["OMP_NUM_THREADS"] == "1"
    assert "--torch-threads=1" in profiles["cpu"].server_args()
    assert resolve_profile_name("auto") in {"cpu", "gpu"}


def test_a_client_that_measures_several_servers_pins_each_away_from_itself(monkeypatch):
    """The streaming client pins itself to the load generator's core, then plans the next server's
    cores again: the plan must still be the machine's, not one read from the client's own affinity."""
    import os

    from benchmarks.harness import streaming

    affinity = {0, 1}  # a two-core machine, whatever this one is; the real process is never pinned
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(affinity), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: (affinity.clear(), affinity.update(cores)), raising=False)
    monkeypatch.setattr(streaming, "_CORE_PLANS", {})
    plans = [streaming.harness_settings("cpu")[0] for _ in range(3)]  # three servers measured in one process
    assert [(h["server_cores"], h["client_cores"], h["pinning"]) for h in plans] == [([0], [1], True)] * 3
    assert affinity == {1}


def test_prompt_streams_are_reproducible_and_inside_the_mix():
    first = [PromptStream(WORKLOADS["default"], 7, 3).next_body() for _ in range(1)]
    stream_a, stream_b = PromptStream(WORKLOADS["default"], 7, 3), PromptStream(WORKLOADS["default"], 7, 3)
    bodies = [stream_a.next_body() for _ in range(50)]
    assert bodies == [stream_b.next_body() for _ in range(50)] and bodies[0] == first[0]
    assert {len(b["input_ids"]) for b in bodies} <= {16, 32, 64, 128}
    assert all(0 <= t < 256 for b in bodies for t in b["input_ids"]) and bodies[0]["max_new_tokens"] == 32
    assert PromptStream(WORKLOADS["long"], 7, 3).next_body()["max_new_tokens"] == 256


@pytest.mark.parametrize(
    ("status", "body", "verdict"),
    [
        (200, {"output_ids": [1, 2, 3]}, None),
        (429, None, "HTTP 429"),
        (200, {"output_ids": [1, 2]}, "200 with 2 output ids, expected 3"),
        (200, {"output_ids": [1, 2, 258]}, "200 with output ids outside [0, 258)"),
        (200, {"text": "no ids"}, "200 without output_ids"),
    ],
)
def test_check_response(status, body, verdict):
    assert check_response(status, body, max_new_tokens=3, vocab_size=258) == verdict


def test_the_harness_never_imports_locust():
    """Locust patches the interpreter with gevent on import: the harness must only start it as a process."""
    code = (
        "import sys, benchmarks.__main__, benchmarks.harness.climb, benchmarks.harness.ceiling, benchmarks.report, "
        "benchmarks.report.readme_blocks, benchmarks.report.reference, benchmarks.report.notebook_plots, benchmarks.notebooks, "
        "benchmarks.harness.calibration, benchmarks.harness.server_stats; print('locust' in sys.modules, 'gevent' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.split() == ["False", "False"]


def test_median_run_keeps_the_middle_run_whole(tmp_path):
    from benchmarks.harness.climb import median_run
    from benchmarks.harness.results import save_result

    paths = []
    for number, qps in enumerate((30.0, 10.0, 20.0)):
        result = synthetic_result("ch03", [SyntheticLevel(1, qps / 2, 50, 60), SyntheticLevel(8, qps, 300, 400)])
        paths.append(save_result(result, tmp_path / f"round{number}"))
    chosen = median_run(paths)
    assert chosen == paths[2]  # 20 QPS: the median of 10, 20, 30
    assert median_run(paths[:2]) == paths[1]  # an even count keeps the lower middle (10 of 10, 30)


def test_the_machines_block_compares_two_reference_climbs(tmp_path: Path):
    from benchmarks.report.climb_blocks import machines_block
    from benchmarks.harness.results import load_results

    here, previous = tmp_path / "here", tmp_path / "previous"
    write_synthetic_climb(here)
    write_synthetic_climb(previous)
    this, before = load_results(here, "default"), load_results(previous, "default")
    # The previous machine was twice as fast at chapter 2 and the same elsewhere.
    before["ch02"].levels[-1].qps *= 2
    block = machines_block(this, before)
    qps_ch02 = this["ch02"].saturation().qps
    assert f"| ch02 | {qps_ch02:.1f} |" in block
    assert "0.50× to 1.00×" in block
    assert machines_block(this, {}).startswith("*Needs both")


def test_the_streaming_block_is_written_from_the_comparison_files(tmp_path: Path):
    import json

    from benchmarks.report.streaming_blocks import streaming_block
    from synthetic_results import write_synthetic_production_and_streaming

    assert streaming_block(tmp_path).startswith("*No streaming comparison yet")
    write_synthetic_production_and_streaming(tmp_path)
    mixed = json.loads((tmp_path / "streaming" / "mixed.json").read_text())
    block = streaming_block(tmp_path)
    for chapter, figures in mixed["chapters"].items():
        assert f"| mixed | {chapter} | {mixed['users']} | {figures['qps']:.1f} |" in block
    assert mixed["command"] in block
    # how the servers ran is stated from the files: pinned with the climb's settings, or each at its defaults
    assert "unpinned" in block
    pinned = {"profile": "cpu", "pinning": True, "server_cores": [0], "client_cores": [1], "server_env": {}}
    (tmp_path / "streaming" / "mixed.json").write_text(json.dumps({**mixed, "harness": pinned}))
    (tmp_path / "streaming" / "default.json").unlink(missing_ok=True)
    block = streaming_block(tmp_path)
    assert "server pinned to cores [0], client to [1]" in block and "unpinned" not in block


def test_a_labelled_run_gets_its_own_bar_in_its_chapter_on_the_climb_chart(tmp_path: Path):
    """A learner's ``--label ch01-mine`` run shows as a bar beside the chapter it reimplements."""
    from benchmarks.report.plots import plot_climb
    from benchmarks.report.tables import build_rows, build_variant_rows
    from benchmarks.harness.results import load_results

    write_synthetic_climb(tmp_path)
    results = load_results(tmp_path, "default")
    rows = build_rows(results, ["ch01", "ch02"], {})
    variants = [row for row, _ in build_variant_rows(results)]
    qps_axes = plot_climb(rows, variants=variants).axes[0]
    bar_labels = [t.get_text() for t in qps_axes.texts]
    assert "ch01-workers" in bar_labels, bar_labels
    heights = {round(patch.get_height(), 3) for patch in qps_axes.patches}
    assert round(results["ch01-workers"].saturation().qps, 3) in heights


# ---------------------------------------------------------------- the packages of benchmarks/


def test_benchmarks_packages_depend_one_way():
    """The harness measures and imports neither the report nor a study; the report reads results and
    imports no study (a study's file format it reads lives in the report); a study may use both."""
    import ast

    from shared.paths import REPO_ROOT

    forbidden = {"harness": ("benchmarks.report", "benchmarks.studies"), "report": ("benchmarks.studies",)}
    offenders = []
    for package, names in forbidden.items():
        for path in sorted((REPO_ROOT / "benchmarks" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                           else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                offenders += [f"{path.relative_to(REPO_ROOT)}: {m}" for m in modules if m.startswith(names)]
    assert not offenders
