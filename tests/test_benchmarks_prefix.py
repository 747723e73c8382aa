"""The prefix-caching measurement's pure parts: the ``shared-prefix`` workload, ``compare``'s variants and
rounds, and the README block written from its files.

No server and no timing: ``compare``'s loop runs against a stand-in for the server and for the client.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness import streaming
from benchmarks.harness.streaming import (
    PREFIX_CACHING_DIR,
    PREFIX_CACHING_PINNED,
    PREFIX_CACHING_VARIANTS,
    PREFIX_CACHING_WORKLOADS,
    Variant,
    median_round,
    parse_variant,
    planned_variants,
    prefix_caching_command,
)
from benchmarks.harness.workload import PROMPT_ID_RANGE, WORKLOADS, PromptStream
from benchmarks.report.readme_blocks import split_workload, update_readmes
from benchmarks.report.streaming_blocks import prefix_caching_block
from shared.model import PRESETS

from synthetic_results import synthetic_prefix_caching_comparison

SHARED = WORKLOADS["shared-prefix"]
MIX = SHARED.shared_prefixes


def _bodies(seed: int, user: int, n: int = 200) -> list[dict]:
    stream = PromptStream(SHARED, seed, user)
    return [stream.next_body() for _ in range(n)]


# ---------------------------------------------------------------- the workload


def test_every_shared_prefix_request_is_one_of_the_prefixes_then_a_suffix_of_its_own():
    assert MIX.count == len(MIX.prefixes) >= 2 and {len(p) for p in MIX.prefixes} == {MIX.length}
    assert len(set(MIX.prefixes)) == MIX.count  # distinct prefixes
    bodies = _bodies(1234, 0) + _bodies(1234, 1)
    used, suffixes = set(), []
    for body in bodies:
        ids = body["input_ids"]
        prefix = tuple(ids[:MIX.length])
        assert prefix in MIX.prefixes
        used.add(prefix)
        assert len(ids) - MIX.length in MIX.suffix_lengths and len(ids) in SHARED.prompt_lengths
        assert body["max_new_tokens"] == SHARED.max_new_tokens
        suffixes.append(tuple(ids[MIX.length:]))
    assert used == set(MIX.prefixes)  # 400 uniform draws over 4 prefixes: each one shared by many requests
    assert len(set(suffixes)) == len(suffixes)  # no two requests share more than their prefix


def test_shared_prefix_bodies_come_from_the_seed_and_the_prefixes_from_no_run_at_all():
    assert _bodies(1234, 3) == _bodies(1234, 3)
    other_seed, other_user = _bodies(99, 3), _bodies(1234, 4)
    assert other_seed != _bodies(1234, 3) and other_user != _bodies(1234, 3)
    # every user of every run shares the same prefixes
    assert {tuple(b["input_ids"][:MIX.length]) for b in other_seed + other_user} <= set(MIX.prefixes)
    assert type(MIX)(**{f: getattr(MIX, f) for f in ("count", "length", "suffix_lengths", "prefix_seed")}).prefixes == MIX.prefixes


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_shared_prefix_workload_fits_every_served_model(preset: str):
    config = PRESETS[preset]
    assert max(SHARED.prompt_lengths) + SHARED.max_new_tokens <= config.n_ctx
    assert PROMPT_ID_RANGE <= config.vocab_size
    assert all(0 <= t < PROMPT_ID_RANGE for body in _bodies(7, 0, 50) for t in body["input_ids"])


def test_the_streaming_client_and_the_locust_harness_send_the_same_shared_prefix_prompts():
    make_body = streaming.WORKLOADS["shared-prefix"]
    for user in (0, 5):
        rng = random.Random(1234 * 1_000_003 + user)  # the streaming client's per-user seed
        assert [make_body(rng) for _ in range(20)] == _bodies(1234, user, 20)


# Digests of the first 20 bodies before the shared-prefix workload was added: the other workloads'
# prompts must stay what every committed result was measured with.
EARLIER_BODIES = {
    ("default", 1234, 0): "e638d008d8b35f5f",
    ("long", 1234, 3): "ca06d7fe6baec296",
    ("streaming-mixed", 1234, 5): "8dd40230ecd49a86",
    ("streaming-default", 1234, 5): "ef121a3fea6792ad",
}


@pytest.mark.parametrize(("workload", "seed", "user"), sorted(EARLIER_BODIES))
def test_the_earlier_workloads_send_the_prompts_they_always_sent(workload: str, seed: int, user: int):
    if workload.startswith("streaming-"):
        rng = random.Random(seed * 1_000_003 + user)
        bodies = [streaming.WORKLOADS[workload.removeprefix("streaming-")](rng) for _ in range(20)]
    else:
        stream = PromptStream(WORKLOADS[workload], seed, user)
        bodies = [stream.next_body() for _ in range(20)]
    assert hashlib.sha256(json.dumps(bodies).encode()).hexdigest()[:16] == EARLIER_BODIES[workload, seed, user]


def test_the_harness_warm_up_keeps_long_prompts_inside_the_vocabulary(monkeypatch):
    from benchmarks.harness import climb as harness

    sent = []

    def post(url, json, timeout):
        sent.append(json)
        return SimpleNamespace(status_code=200, json=lambda: {"output_ids": [1] * json["max_new_tokens"]}, text="")

    monkeypatch.setattr(harness.requests, "post", post)
    harness.warm_up("http://127.0.0.1:1", SHARED, count=6, vocab_size=PRESETS["tiny"].vocab_size, timeout_s=1.0)
    assert len(sent) == 6 and {len(b["input_ids"]) for b in sent[:3]} == set(SHARED.prompt_lengths)
    assert all(0 <= t < PROMPT_ID_RANGE for body in sent for t in body["input_ids"])


def test_a_block_key_may_end_with_a_hyphenated_workload():
    assert split_workload("ch08-shared-prefix") == ("ch08", "shared-prefix")
    assert split_workload("ch04-long") == ("ch04", "long")
    assert split_workload("ch08-prefix-caching") == ("ch08-prefix-caching", "default")
    assert split_workload("ch01-workers") == ("ch01-workers", "default")


# ---------------------------------------------------------------- compare's variants and rounds


def test_parse_variant():
    assert parse_variant("caching-off=ch08:--prefix-caching=off") == Variant("caching-off", "ch08", ("--prefix-caching=off",))
    assert parse_variant("two=ch08:--a 1 --b 'x y'") == Variant("two", "ch08", ("--a", "1", "--b", "x y"))
    assert parse_variant("plain=ch06") == Variant("plain", "ch06", ())
    assert parse_variant("on=ch08:--x").streams and not parse_variant("off=ch06").streams


@pytest.mark.parametrize("text", ["ch08", "=ch08:--a", "x=chapter8", "x=ch08:--a 'b", "a b=ch08", "x=:--a"])
def test_parse_variant_refuses_what_it_cannot_read(text: str):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant(text)


def test_planned_variants():
    assert planned_variants(None, []) == [Variant("ch06", "ch06"), Variant("ch08", "ch08")]
    on = Variant("on", "ch08", ("--prefix-caching=on",))
    assert planned_variants(None, [on]) == [on]
    assert planned_variants(["ch07"], [on]) == [Variant("ch07", "ch07"), on]
    with pytest.raises(ValueError, match="repeated: ch08"):
        planned_variants(["ch08"], [Variant("ch08", "ch08", ("--x",))])


def test_median_round_keeps_the_middle_round_whole_and_every_round_beside_it():
    rounds = [{"qps": 3.0, "n": 0}, {"qps": 1.0, "n": 1}, {"qps": 2.0, "n": 2}, {"qps": 4.0, "n": 3}]
    kept = median_round(rounds)
    assert kept["n"] == 2 and kept["rounds"] == rounds  # the lower middle of four, as the climb's repeats
    assert median_round(rounds[:1]) == rounds[0] and "rounds" not in median_round(rounds[:1])


@pytest.mark.parametrize("argv", [
    ["compare", "--variant", "nonsense"],
    ["compare", "--variant", "a=ch08", "--variant", "a=ch08:--x"],
    ["compare", "--variant", "a=ch42"],
    ["compare", "--rounds", "0"],
])
def test_compare_refuses_bad_variants_before_starting_any_server(argv, monkeypatch):
    monkeypatch.setattr("benchmarks.harness.server_process.running_module", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(SystemExit) as exit_info:
        streaming.main(argv)
    assert exit_info.value.code == 2


def test_compare_runs_the_variants_round_by_round_and_keeps_each_ones_median(monkeypatch, tmp_path: Path, capsys):
    started, qps = [], iter([5.0, 1.0, 2.0, 7.0, 6.0, 3.0])  # on, off, then off, on (reversed), then on, off

    @contextlib.contextmanager
    def fake_server(module, args, *, name, env, cpu_cores):
        started.append((module, name, list(args)))
        yield SimpleNamespace(url=f"http://127.0.0.1:1/{name}")

    def fake_run(args, url, stream):
        return {"qps": next(qps), "url": url, "stream": stream}

    monkeypatch.setattr("benchmarks.harness.server_process.running_module", fake_server)
    monkeypatch.setattr(streaming, "_run", fake_run)
    # what each server's /stats says of its prefix cache at the end of its run (caching-off: nothing looked up)
    monkeypatch.setattr(streaming, "server_choices",
                        lambda url: {"prefix_cache": {"hit_rate": 0.9 if url.endswith("caching-on") else None}, "attention": "flex"})
    out = tmp_path / "shared-prefix.json"
    argv = ["compare", "--variant", "caching-on=ch08:--prefix-caching=on", "--variant", "caching-off=ch08:--prefix-caching off",
            "--server-args", "--log-level warning", "--workload", "shared-prefix", "--rounds", "3", "--out", str(out)]
    streaming.main(argv)
    capsys.readouterr()
    assert [name for _, name, _ in started] == ["caching-on", "caching-off", "caching-off", "caching-on", "caching-on", "caching-off"]
    assert {module for module, _, _ in started} == {"chapters.ch08_continuous_batching"}
    # the variant's own flags come last, so they win over --server-args
    assert started[1][2] == ["--log-level", "warning", "--prefix-caching", "off"]
    document = json.loads(out.read_text())
    assert document["rounds"] == 3 and document["workload"] == "shared-prefix"
    assert document["variants"] == {"caching-on": {"chapter": "ch08", "flags": "--prefix-caching=on"},
                                    "caching-off": {"chapter": "ch08", "flags": "--prefix-caching off"}}
    assert document["chapters"]["caching-on"]["qps"] == 6.0 and document["chapters"]["caching-off"]["qps"] == 2.0
    assert [r["qps"] for r in document["chapters"]["caching-on"]["rounds"]] == [5.0, 7.0, 6.0]
    assert document["chapters"]["caching-on"]["streamed"] is True
    assert document["chapters"]["caching-on"]["prefix_cache"] == {"hit_rate": 0.9}  # the kept round's server
    assert document["chapters"]["caching-off"]["prefix_cache"] == {"hit_rate": None}
    assert document["chapters"]["caching-off"]["attention"] == "flex"  # what its start-up rule chose, recorded
    assert document["command"].startswith("python -m benchmarks.harness.streaming compare --variant caching-on=ch08:--prefix-caching=on")
    assert "'caching-off=ch08:--prefix-caching off'" in document["command"]  # quoted: it can be pasted back


@pytest.mark.parametrize("workload", PREFIX_CACHING_WORKLOADS)
def test_the_readme_blocks_command_is_one_the_client_accepts(workload: str):
    program, *argv = shlex.split(prefix_caching_command(workload))[2:]  # after "python -m"
    assert program == "benchmarks.harness.streaming"
    args = streaming.build_parser().parse_args(argv)
    assert (args.command, args.profile, args.workload, args.server_args) == ("compare", "cpu", workload, PREFIX_CACHING_PINNED)
    assert {v.label: (v.chapter, v.flags) for v in args.variant} == {
        label: ("ch08", (flag,)) for label, flag in PREFIX_CACHING_VARIANTS.items()}
    assert args.out == Path(f"benchmarks/reference/cpu/{PREFIX_CACHING_DIR}/{workload}.json")


# ---------------------------------------------------------------- the README block


def _write(directory: Path, workload: str) -> dict:
    document = synthetic_prefix_caching_comparison(workload)
    path = directory / PREFIX_CACHING_DIR / f"{workload}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return document


def test_the_prefix_caching_block_says_which_command_records_its_results(tmp_path: Path):
    block = prefix_caching_block(tmp_path)
    assert block.startswith("*No prefix-caching comparison yet")
    assert prefix_caching_command("shared-prefix", tmp_path.as_posix()) in block


def test_the_prefix_caching_block_has_a_table_per_workload_with_on_over_off(tmp_path: Path):
    shared = _write(tmp_path, "shared-prefix")
    _write(tmp_path, "default")
    block = prefix_caching_block(tmp_path)
    assert block.index("**`shared-prefix`**") < block.index("**`default`**")  # the workload that shares first
    on, off = shared["chapters"]["caching-on"], shared["chapters"]["caching-off"]
    assert f"| on | {on['qps']:.1f} | {on['ttft_ms']['p50']:,.0f} / {on['ttft_ms']['p99']:,.0f} | {on['tpot_ms']['p50']:,.0f} | 0 | — |" in block
    assert f"| off | {off['qps']:.1f} |" in block
    ratios = (f"| on / off | {on['qps'] / off['qps']:.2f}× | {on['ttft_ms']['p50'] / off['ttft_ms']['p50']:.2f}× / "
              f"{on['ttft_ms']['p99'] / off['ttft_ms']['p99']:.2f}× | {on['tpot_ms']['p50'] / off['tpot_ms']['p50']:.2f}× | | |")
    assert ratios in block
    assert "median-QPS round of 2" in block and f"{MIX.count} prefixes of {MIX.length} ids" in block
    # mixed has no file yet: the block says how to record it
    assert f"Not measured yet: `{prefix_caching_command('mixed', tmp_path.as_posix())}`" in block


def test_the_prefix_caching_block_shows_a_variant_missing_from_a_file(tmp_path: Path):
    document = _write(tmp_path, "shared-prefix")
    del document["chapters"]["caching-off"]
    (tmp_path / PREFIX_CACHING_DIR / "shared-prefix.json").write_text(json.dumps(document))
    block = prefix_caching_block(tmp_path)
    assert "| off | not measured | | | | |" in block and "| on / off | — | — / — | — | | |" in block


def test_the_prefix_caching_block_shows_the_servers_hit_rate_where_recorded(tmp_path: Path):
    document = _write(tmp_path, "shared-prefix")
    document["chapters"]["caching-on"]["prefix_cache"] = {"hit_rate": 0.8734, "lookups_tokens": 1000, "hits_tokens": 873}
    document["chapters"]["caching-off"]["prefix_cache"] = {"hit_rate": None, "lookups_tokens": 0, "hits_tokens": 0}
    (tmp_path / PREFIX_CACHING_DIR / "shared-prefix.json").write_text(json.dumps(document))
    block = prefix_caching_block(tmp_path)
    on_row = next(line for line in block.splitlines() if line.startswith("| on |"))
    off_row = next(line for line in block.splitlines() if line.startswith("| off |"))
    assert on_row.endswith("| 87% |") and off_row.endswith("| — |")


def test_the_sampling_block_reads_every_round_and_the_median_ratio(tmp_path: Path):
    from benchmarks.report.study_blocks import sampling_block

    assert "--sampling-rounds 5" in sampling_block(tmp_path)  # nothing recorded: the command that records it
    rounds = [{"order": ["greedy", "sampled"], "greedy": {"requests_per_s": 40.0, "median_update_ms": 0.4},
               "sampled": {"requests_per_s": 38.0, "median_update_ms": 0.9}},
              {"order": ["sampled", "greedy"], "greedy": {"requests_per_s": 50.0, "median_update_ms": 0.5},
               "sampled": {"requests_per_s": 45.0, "median_update_ms": 1.1}}]
    (tmp_path / "ch08").mkdir()
    (tmp_path / "ch08" / "sampling.json").write_text(json.dumps({
        "command": "python -m benchmarks.studies.ch08_step_profile.profile_ch08 --sampling-rounds 2", "steps": 50, "rounds": rounds, "median_ratio": 0.925,
        "greedy": "attention flex, engine eager/fp32, KV cache float32, workload default, 64 sequences, greedy",
        "sampled": "attention flex, engine eager/fp32, KV cache float32, workload default, 64 sequences, temperature 1"}))
    block = sampling_block(tmp_path)
    assert "| 1 (greedy first, sampled second) | 40.0 | 38.0 | 0.95× | 0.40 / 0.90 |" in block
    assert "| 2 (sampled first, greedy second) | 50.0 | 45.0 | 0.90× | 0.50 / 1.10 |" in block
    assert "**0.93×**" in block and "against temperature 1" in block


def test_update_readmes_fills_the_prefix_caching_marker(tmp_path: Path):
    _write(tmp_path, "shared-prefix")
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- results:ch08-prefix-caching -->\nold\n<!-- /results -->\nafter\n")
    assert update_readmes([readme], directory=tmp_path) == [readme]
    text = readme.read_text()
    assert text.startswith("before\n<!-- results:ch08-prefix-caching -->\n**`shared-prefix`**") and text.endswith("after\n")
    assert "old" not in text


# ---------------------------------------------------------------- the notebook's plot


def test_the_prefix_caching_plot_draws_from_the_synthetic_files_and_names_its_command_without_them(tmp_path: Path):
    from benchmarks.report.notebook_plots import MissingData, load_prefix_caching, plot_prefix_caching
    from synthetic_results import write_synthetic_production_and_streaming

    with pytest.raises(MissingData, match="--workload shared-prefix"):
        load_prefix_caching(tmp_path)
    write_synthetic_production_and_streaming(tmp_path)
    comparisons = load_prefix_caching(tmp_path)
    assert list(comparisons) == ["shared-prefix", "default", "mixed"]
    figure = plot_prefix_caching(comparisons)
    ttft_ax, qps_ax = figure.axes
    assert "Time to first token" in ttft_ax.get_title() and "QPS" in qps_ax.get_title()
    on_qps = [bar.get_height() for bar in qps_ax.containers[0]]
    assert on_qps == [comparisons[w]["chapters"]["caching-on"]["qps"] for w in comparisons]



def test_the_streaming_client_counts_every_token_of_a_real_stream_and_every_failure():
    """The closed loop against the trivial server (a real uvicorn, streaming when asked): every record
    holds exactly the 32 tokens each ``default`` body asks for, the first no earlier than the send and
    no later than the end; a port where nothing listens gives failed records (status -1) within the
    loop's time, not an exception."""
    import asyncio

    from benchmarks.harness.server_process import free_port, running_module

    assert {streaming.WORKLOADS["default"](random.Random(seed))["max_new_tokens"] for seed in range(20)} == {32}
    with running_module("benchmarks.harness.trivial_server", name="instant") as server:
        for stream in (True, False):
            records, _ = asyncio.run(streaming.run_closed_loop(server.url, 3, 0.5, "default", stream, seed=7))
            assert records and all(r.status == 200 and r.output_tokens == 32 for r in records)
            if stream:
                assert all(len(r.token_times) == 32 and r.sent <= r.token_times[0] <= r.ended for r in records)
    records, window = asyncio.run(streaming.run_closed_loop(f"http://127.0.0.1:{free_port()}", 2, 0.3, "default", True))
    assert records and {r.status for r in records} == {-1} and window < 10


def test_the_targets_block_judges_prefix_cachings_ttft_against_a_third_of_caching_off(tmp_path: Path):
    from benchmarks.report.streaming_blocks import PREFIX_CACHING_TTFT_TARGET, _prefix_caching_target_rows

    assert "not measured" in _prefix_caching_target_rows(tmp_path)[0]
    document = _write(tmp_path, "shared-prefix")
    on, off = document["chapters"]["caching-on"], document["chapters"]["caching-off"]
    for on_ms, verdict in ((off["ttft_ms"]["p50"] * 0.5, "**no**"), (off["ttft_ms"]["p50"] * 0.25, "yes")):
        on["ttft_ms"]["p50"] = on_ms  # the median-QPS round's figure is what the row reads
        (tmp_path / PREFIX_CACHING_DIR / "shared-prefix.json").write_text(json.dumps(document))
        row = _prefix_caching_target_rows(tmp_path)[0]
        assert f"| {on_ms / off['ttft_ms']['p50']:.2f}× |" in row and row.endswith(f"| {verdict} |"), row
        assert f"<= {PREFIX_CACHING_TTFT_TARGET:.2f}×" in row
    # a second load (fewer users) is a row of its own, fewest users first; the first file's verdict unchanged
    light = json.loads(json.dumps(document))
    light["users"] = 4
    light["chapters"]["caching-on"]["ttft_ms"]["p50"] = off["ttft_ms"]["p50"] * 0.5
    (tmp_path / PREFIX_CACHING_DIR / "shared-prefix-4-users.json").write_text(json.dumps(light))
    rows = _prefix_caching_target_rows(tmp_path)
    assert len(rows) == 2 and "| shared-prefix | 4 |" in rows[0] and rows[0].endswith("| **no** |"), rows
    assert f"| shared-prefix | {document['users']} |" in rows[1] and rows[1].endswith("| yes |"), rows
