"""README blocks of the harness's own runs: a chapter against the one before it, the whole climb,
climbs of some chapters only, and two machines side by side.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from benchmarks.harness.article import ARTICLE, ARTICLE_CHAPTERS, BASELINE
from benchmarks.harness.results import (
    REFERENCE_ROOT,
    BenchmarkResult,
    find_calibration,
    load_open_loop_results,
    load_results,
    result_filename,
)
from benchmarks.report import missing_chapter_notes, report_names
from benchmarks.report.paths import relative_path, repo_path
from benchmarks.report.tables import (
    TableRow,
    ceiling_line,
    environment_line,
    measured_row,
    render_calibration,
    render_table,
    representative,
)


# How a profile's committed climb was made, when not by ``make climb`` (shown under its table).
CLIMB_REPRODUCE = {
    "cpu-previous": ("not here: the climb of the machine the previous reference was measured on, kept so that "
                     "two machines can be compared (the table of the two machines above)"),
    "gpu": ("`bash benchmarks/harness/gpu_climb.sh OUTDIR` on a CUDA machine (one round, one run per chapter: "
            "sized for a 10-minute lease; `make climb PROFILE=gpu` runs three rounds)"),
}


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
        f"[`{repo_path(directory / _file(r))}`]({relative_path(directory / _file(r), readme)})" for r in files
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
        f"![{alt}]({relative_path(directory / name, readme)})"
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
        f"Reference results: [`{repo_path(directory)}/`]({relative_path(directory, readme)}/) "
        f"(rewritten by `python -m benchmarks readme --profile {profile}`)."
    )
    return "\n\n".join(parts)


# Climbs of some chapters only, kept in a folder of their own (``key`` -> folder under the cpu reference, how it was run).
PARTIAL_CLIMBS = {
    "climb-avx2": ("climb-avx2", "`python -m benchmarks climb --profile cpu --repeat 3 --out benchmarks/reference/cpu/climb-avx2` "
                   "(three interleaved rounds, each chapter's median run kept; `climb.log` beside the results is the command's "
                   "output, every round's every level)"),
    "climb-smollm2": ("climb-smollm2", "`make climb WEIGHTS=smollm2 REPEAT=1`, copied to `benchmarks/reference/cpu/climb-smollm2` "
                      "(one round: the default workload's loads with SmolLM2-135M-Instruct served; `climb.log` beside the "
                      "results is the command's output)"),
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
    images = "\n".join(f"![{alt}]({relative_path(directory / name, readme)})"
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


# The root README's climb: both models side by side, each from its folder under the cpu reference (``key`` -> the two).
TWO_MODELS = {"climb-models": (("embedded GPT, 3.3 M", "climb-avx2"), ("SmolLM2-135M-Instruct", "climb-smollm2"))}


def two_models_block(models: tuple[tuple[str, str], ...], readme: Path) -> str:
    """Each chapter's saturation QPS, its ratio to chapter 1 and its P99 at the top load, for each model's
    climb (a :data:`PARTIAL_CLIMBS` folder), beside the article's ratio; then where each ran and its full report."""
    loaded = [(name, folder, load_results(REFERENCE_ROOT / "cpu" / folder, "default")) for name, folder in models]
    rows = {name: {r.chapter: measured_row(r, None) for r in results.values() if r.label == r.chapter} for name, _, results in loaded}
    chapters = sorted({c for by_chapter in rows.values() for c in by_chapter})
    head = "| chapter | " + " | ".join(f"{name}: QPS | × ch01 | P99 at top load (ms)" for name, _, _ in loaded) + " | article × ch01 |"
    lines = [head, "|---|" + "---|---|---|" * len(loaded) + "---|"]
    for chapter in chapters:
        cells = []
        for name, _, _ in loaded:
            row, first = rows[name].get(chapter), rows[name].get("ch01")
            if row is None or not row.qps:
                cells += ["—", "—", "—"]
                continue
            ratio = f"{row.qps / first.qps:.2f}×" if first is not None and first.qps else "—"
            p99 = f"{row.p99_top_ms:,.0f} at {row.top_users}" if row.p99_top_ms is not None else "—"
            cells += [f"{row.qps:.1f}", ratio, p99]
        article = ARTICLE.get(chapter)
        cells.append(f"{article.qps / ARTICLE[BASELINE].qps:.2f}×" if article else "—")
        lines.append(f"| {chapter} | " + " | ".join(cells) + " |")
    where = []
    for name, folder, results in loaded:
        if not results:
            where.append(f"{name}: *no results yet*")
            continue
        env = representative(results).environment
        report = relative_path(REFERENCE_ROOT / "cpu" / folder / "climb.md", readme)
        where.append(f"{name}: {env.cpu_model}, {env.logical_cores} cores, commit {str(env.git_commit)[:10]}, "
                     f"[the whole report]({report})")
    return "\n".join(lines) + "\n\nQPS at each chapter's best load; P99 at the top load (ms at users). " + "; ".join(where) + "."
