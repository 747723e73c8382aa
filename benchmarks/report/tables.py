"""The climb's markdown: one row per chapter, the same-load comparisons, warnings, the calibration.

- *saturation*: the level with the highest successful QPS; a chapter's QPS, P50, P99 and tokens/s
  in the table are that level's.
- *P99 at the top load*: the P99 at the highest concurrency measured, the same load for every chapter
  of a profile: a saturation P99 would compare a chapter that is saturated at one user (ch01) at one
  user with the others at 64.
- *the same load*: chapters are also compared at every concurrency level they all measured, and at
  every offered rate their open-loop sweeps all measured, never only at each one's own saturation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.article import ARTICLE, ARTICLE_CHAPTERS, BASELINE
from benchmarks.harness.climb import describe_load_generator
from benchmarks.harness.results import BenchmarkResult, Calibration, OpenLoopResult, load_result
from benchmarks.report.knees import (
    OPEN_MAX_ERROR_SHARE,
    OPEN_MIN_ACHIEVED_SHARE,
    OPEN_P99_KNEE_FACTOR,
    describe_open_knee,
    knee_of,
    open_knee_of,
)


LOADGEN_CPU_WARNING_PERCENT = 80.0


@dataclass(frozen=True)
class TableRow:
    label: str
    chapter: str
    measured: bool
    note: str  # why a chapter has no figures ("not built yet")
    users: int | None = None  # the saturation level
    qps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    tokens_per_s: float | None = None
    errors: int = 0
    errors_by_status: tuple[tuple[str, int], ...] = ()
    ratio_to_baseline: float | None = None
    knee_users: int | None = None
    knee_reached: bool = False
    top_users: int | None = None  # the highest load measured
    p50_top_ms: float | None = None  # the P50 there
    p99_top_ms: float | None = None  # the P99 there
    server_rss_mb_max: float | None = None  # the server's largest resident memory over every level
    article_qps: float | None = None
    article_p99_ms: float | None = None
    article_ratio: float | None = None


def _errors(result: BenchmarkResult) -> dict[str, int]:
    total: dict[str, int] = {}
    for level in result.levels:
        for status, count in level.errors_by_status.items():
            total[status] = total.get(status, 0) + count
    return dict(sorted(total.items()))


def measured_row(result: BenchmarkResult, baseline_qps: float | None) -> TableRow:
    saturation = result.saturation()
    errors = _errors(result)
    knee = knee_of(result)
    top = max(result.levels, key=lambda level: level.users, default=None)
    return TableRow(
        label=result.label, chapter=result.chapter, measured=True, note="",
        users=saturation.users if saturation else None,
        qps=saturation.qps if saturation else None,
        p50_ms=saturation.latency_ms.p50 if saturation and saturation.latency_ms else None,
        p99_ms=saturation.latency_ms.p99 if saturation and saturation.latency_ms else None,
        tokens_per_s=saturation.tokens_per_s if saturation else None,
        errors=sum(errors.values()), errors_by_status=tuple(errors.items()),
        ratio_to_baseline=(saturation.qps / baseline_qps) if saturation and baseline_qps else None,
        knee_users=knee.users if knee else None, knee_reached=bool(knee and knee.reached),
        top_users=top.users if top else None,
        p50_top_ms=top.latency_ms.p50 if top and top.latency_ms else None,
        p99_top_ms=top.latency_ms.p99 if top and top.latency_ms else None,
        server_rss_mb_max=max((lvl.server_rss_mb_max for lvl in result.levels if lvl.server_rss_mb_max is not None), default=None),
        **_article_fields(result.label),  # a variant's label is not a chapter: no article figures
    )


def _article_fields(chapter: str) -> dict:
    article = ARTICLE.get(chapter)
    if article is None:
        return {}
    return {
        "article_qps": article.qps,
        "article_p99_ms": article.p99_s * 1e3,
        "article_ratio": article.qps / ARTICLE[BASELINE].qps,
    }


def build_rows(
    results: Mapping[str, BenchmarkResult], chapters: Sequence[str] | None = None,
    missing_notes: Mapping[str, str] | None = None,
) -> list[TableRow]:
    """One row per chapter of ``chapters`` (default: the article's and every measured one), in order.

    Only main results count here (label == chapter); variants go to :func:`build_variant_rows`.
    A chapter without a result gets a row with the article's figures and a note (``missing_notes``,
    default "not measured").
    """
    main = {label: r for label, r in results.items() if r.label == r.chapter}
    order = list(chapters) if chapters is not None else sorted(set(ARTICLE_CHAPTERS) | set(main))
    baseline = main.get(BASELINE)
    baseline_qps = baseline.saturation().qps if baseline and baseline.saturation() else None
    rows = []
    for chapter in order:
        if chapter in main:
            rows.append(measured_row(main[chapter], baseline_qps))
        else:
            note = (missing_notes or {}).get(chapter, "not measured")
            rows.append(TableRow(label=chapter, chapter=chapter, measured=False, note=note, **_article_fields(chapter)))
    return rows


def build_variant_rows(results: Mapping[str, BenchmarkResult]) -> list[tuple[TableRow, float | None]]:
    """Variants (label != chapter) with their QPS ratio to their own chapter's main result."""
    rows = []
    for label in sorted(results):
        result = results[label]
        if result.label == result.chapter:
            continue
        base = results.get(result.chapter)
        base_qps = base.saturation().qps if base and base.saturation() else None
        row = measured_row(result, None)
        rows.append((row, (row.qps / base_qps) if row.qps is not None and base_qps else None))
    return rows


def _fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}{suffix}"


def _errors_cell(row: TableRow) -> str:
    if not row.measured:
        return "—"
    if not row.errors:
        return "0"
    detail = ", ".join(f"{status}: {count}" for status, count in row.errors_by_status)
    return f"{row.errors} ({detail})"


def _knee_cell(row: TableRow) -> str:
    if row.knee_users is None:
        return "—"
    return str(row.knee_users) if row.knee_reached else f"> {row.knee_users}"


TABLE_HEADER = (
    "| chapter | QPS | tokens/s | at users | P50 (ms) | P99 (ms) | at users | saturates at (users) | errors | × ch01 "
    "| article QPS | article P99 (ms) | article × ch01 |"
)
# Latencies compare only at equal load: every chapter's P50/P99 at the same (top) level, never at its own best.
TABLE_NOTE = ("QPS and tokens/s at each chapter's best level (the first `at users`); P50 and P99 at the top load, "
              "the same number of users for every chapter (the second `at users`).")


def render_rows(rows: Sequence[TableRow]) -> list[str]:
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for row in rows:
        if row.measured:
            cells = [
                row.label, _fmt(row.qps, 1), _fmt(row.tokens_per_s), str(row.users), _fmt(row.p50_top_ms),
                _fmt(row.p99_top_ms), str(row.top_users), _knee_cell(row), _errors_cell(row),
                _fmt(row.ratio_to_baseline, 2, "×"),
            ]
        else:
            cells = [row.label, f"*{row.note}*", "—", "—", "—", "—", "—", "—", "—", "—"]
        cells += [_fmt(row.article_qps), _fmt(row.article_p99_ms), _fmt(row.article_ratio, 2, "×")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_variants(variant_rows: Sequence[tuple[TableRow, float | None]]) -> list[str]:
    if not variant_rows:
        return []
    lines = [
        "", "Variants (same profile, a chapter with other flags):", "",
        "| run | chapter | QPS | P50 (ms) | P99 (ms) | users | errors | × its chapter |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, ratio in variant_rows:
        lines.append(
            f"| {row.label} | {row.chapter} | {_fmt(row.qps, 1)} | {_fmt(row.p50_ms)} | {_fmt(row.p99_ms)} "
            f"| {row.users} | {_errors_cell(row)} | {_fmt(ratio, 2, '×')} |"
        )
    return lines


def representative(results: Mapping[str, BenchmarkResult]) -> BenchmarkResult:
    """The result that speaks for a set: the first chapter's own run (a variant only when there is none)."""
    return next((r for r in results.values() if r.label == r.chapter), None) or next(iter(results.values()))


def loadgen_workers_of(result: BenchmarkResult | OpenLoopResult) -> int:
    """The Locust workers of a result's load generator; 0: one process."""
    return result.config.load_generator.workers


def loadgen_cores_of(result: BenchmarkResult) -> int:
    """How many cores the load generator could use: its pinned cores, else one per Locust process that runs
    users (each is a single gevent thread)."""
    env = result.environment
    if env.pinning and env.loadgen_cores:
        return len(env.loadgen_cores)
    return max(1, loadgen_workers_of(result))


def environment_line(results: Mapping[str, BenchmarkResult]) -> str:
    """One sentence on where the figures come from (from the first result; differences are warned about)."""
    if not results:
        return ""
    first = representative(results)
    env, config = first.environment, first.config
    where = env.gpu or f"{env.cpu_model} ({env.logical_cores} cores)"
    pinning = (
        f"server on cores {env.server_cores}, Locust on {env.loadgen_cores}" if env.pinning else "no core pinning"
    )
    if loadgen_workers_of(first):  # one process, the default, goes unsaid
        pinning += f"; {describe_load_generator(loadgen_workers_of(first))}"
    commit = (env.git_commit or "unknown")[:10] + (" (dirty)" if env.git_dirty else "")
    return (
        f"Profile `{config.profile}`, workload `{config.workload}` ({config.max_new_tokens} new tokens, prompts "
        f"{'/'.join(map(str, config.prompt_lengths))}), closed loop. Measured on {where}; {pinning}; torch threads "
        f"{env.torch_threads}; torch {env.torch}; commit {commit}. Saturation: the level with the highest QPS; "
        f"top load: the highest level measured; saturates at: the lowest load whose QPS reaches 90 % of the best (\"> N\": not within the loads measured)."
    )


SERVER_WAIT_WARNING_PERCENT = 10.0


def warnings_for(results: Mapping[str, BenchmarkResult]) -> list[str]:
    """What makes a figure doubtful: a busy or starved load generator, a server competing for its cores,
    a small latency sample, results from different code."""
    warnings = []
    for label, result in results.items():
        cores = loadgen_cores_of(result)  # a distributed load generator's CPU is summed over its processes
        budget = LOADGEN_CPU_WARNING_PERCENT * cores
        its_cores = "its core" if cores == 1 else f"its {cores} cores (100 % = one core)"
        for level in result.levels:
            used, waited = level.loadgen_cpu_percent, level.loadgen_cpu_wait_percent
            if used is not None and used > budget:
                warnings.append(
                    f"{label} at {level.users} users: the load generator used {used:.0f} % of {its_cores}; "
                    f"this figure may measure Locust, not the server."
                )
            elif used is not None and waited is not None and used + waited > budget:
                warnings.append(
                    f"{label} at {level.users} users: the load generator used {used:.0f} % of {its_cores} and waited "
                    f"{waited:.0f} % for it (other processes on its core): this figure may measure the client's starvation."
                )
        server_waits = [lvl.server_cpu_wait_percent for lvl in result.levels if lvl.server_cpu_wait_percent is not None]
        if server_waits and max(server_waits) > SERVER_WAIT_WARNING_PERCENT:
            warnings.append(
                f"{label}: the server's threads were ready to run but waiting for a CPU up to {max(server_waits):.0f} % "
                f"of the time (other processes on its cores, or its own threads queuing for them): on a quiet machine "
                f"its figures may be better."
            )
        load = result.environment.load_average_at_start
        if not server_waits and load and load[0] > 0.5 * result.environment.logical_cores:
            warnings.append(
                f"{label}: load average {load[0]:.1f} at the start on {result.environment.logical_cores} cores: "
                f"other work on the machine may have slowed it."
            )
        small = [lvl.users for lvl in result.levels if lvl.latency_sample < result.config.target_requests]
        if small:
            warnings.append(
                f"{label}: fewer than {result.config.target_requests} requests measured at concurrency "
                f"{', '.join(map(str, small))} (the level hit its time limit): the P99 there is rough."
            )
    profiles = {r.config.profile for r in results.values()}
    if len(profiles) > 1:
        warnings.append(f"the results come from different profiles ({', '.join(sorted(profiles))}): they do not compare.")
    tops = {r.label: max(lvl.users for lvl in r.levels) for r in results.values() if r.label == r.chapter and r.levels}
    if len(set(tops.values())) > 1:
        listed = ", ".join(f"{label} {users}" for label, users in sorted(tops.items()))
        warnings.append(f"the chapters' top loads differ ({listed}): their P50/P99 columns are not at the same load.")
    commits = {(r.environment.git_commit, r.environment.git_dirty) for r in results.values()}
    if len(commits) > 1:
        warnings.append("the results come from different commits (or dirty trees): compare with care.")
    generators = {loadgen_workers_of(r) for r in results.values()}
    if len(generators) > 1:
        listed = ", ".join(f"{label}: {describe_load_generator(loadgen_workers_of(r))}" for label, r in sorted(results.items()))
        warnings.append(f"the results come from different load generators ({listed}): a client-bound figure does not compare.")
    return warnings


def load_ceilings(directory: Path) -> dict[str, BenchmarkResult]:
    """The harness's ceilings in ``directory``, by label: ``ceiling`` (one Locust process) and
    ``ceiling-workers<N>`` (distributed), fewest workers first."""
    ceilings = []
    for path in sorted(Path(directory).glob("ceiling*.json")):
        try:
            result = load_result(path)
        except ValueError:
            continue
        if result.chapter == "ceiling" and result.levels:
            ceilings.append(result)
    return {r.label: r for r in sorted(ceilings, key=loadgen_workers_of)}


def ceiling_line(directory: Path) -> str:
    """The ceilings measured, each with how Locust ran (one process: no word on workers)."""
    sentences = []
    for ceiling in load_ceilings(directory).values():
        top = ceiling.saturation()
        workers = loadgen_workers_of(ceiling)
        if workers == 0:
            cpu = f", Locust at {top.loadgen_cpu_percent:.0f} % of its core" if top.loadgen_cpu_percent is not None else ""
        else:
            cores = loadgen_cores_of(ceiling)
            cpu = "" if top.loadgen_cpu_percent is None else (
                f", Locust's processes at {top.loadgen_cpu_percent:.0f} % of one core in all, on {cores} "
                f"core{'s' if cores > 1 else ''}")
        if top.loadgen_cpu_wait_percent is not None and top.loadgen_cpu_wait_percent > SERVER_WAIT_WARNING_PERCENT:
            cpu += f" (and waiting {top.loadgen_cpu_wait_percent:.0f} % for it: a busy machine lowers the ceiling)"
        how = "Locust" if workers == 0 else f"Locust distributed, a master and {workers} worker{'s' if workers > 1 else ''},"
        sentences.append(
            f"Harness ceiling ({how} against an instant endpoint): {top.qps:,.0f} QPS at {top.users} users{cpu}; "
            f"a chapter near it measures the load generator."
        )
    return " ".join(sentences)


def _latency_pair(p50: float | None, p99: float | None) -> str:
    return "—" if p50 is None or p99 is None else f"{_fmt(p50)} / {_fmt(p99)}"


def common_levels(results: Mapping[str, BenchmarkResult]) -> list[int]:
    """Concurrency levels that every main (non-variant) result measured with successes, ascending."""
    main = [r for r in results.values() if r.label == r.chapter]
    sets = [{lvl.users for lvl in r.levels if lvl.latency_ms is not None} for r in main]
    return sorted(set.intersection(*sets)) if sets else []


def render_same_load(results: Mapping[str, BenchmarkResult]) -> list[str]:
    """P50 / P99 of every chapter at each concurrency level they all measured: the same load for all."""
    levels = common_levels(results)
    main = {label: r for label, r in sorted(results.items()) if r.label == r.chapter}
    if not levels or len(main) < 2:
        return []
    header = "| chapter | " + " | ".join(f"{users} users: P50 / P99 (ms)" for users in levels) + " |"
    lines = ["", "At the same load (closed loop: every chapter at the same number of requests in flight):", "",
             header, "|---|" + "---|" * len(levels)]
    for label, result in main.items():
        cells = []
        for users in levels:
            level = result.level(users)
            latency = level.latency_ms if level else None
            cells.append(_latency_pair(latency.p50 if latency else None, latency.p99 if latency else None))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def common_rates(open_results: Mapping[str, OpenLoopResult]) -> list[float]:
    """Offered rates that every main open-loop sweep measured with successes, ascending."""
    main = [r for r in open_results.values() if r.label == r.chapter]
    sets = [{lvl.offered_rps for lvl in r.levels if lvl.latency_ms is not None} for r in main]
    return sorted(set.intersection(*sets)) if sets else []


def render_open_loop(open_results: Mapping[str, OpenLoopResult]) -> list[str]:
    """Per chapter: the knee, the best goodput and why the sweep stopped; then P50 / P99 at the rates all measured."""
    if not open_results:
        return []
    first = next(iter(open_results.values())).config
    lines = [
        "", f"Open loop (Poisson arrivals at a fixed offered rate; SLO {first.slo_ms:,.0f} ms for goodput; knee: last "
        f"rate before P99 exceeds {OPEN_P99_KNEE_FACTOR:g}× its value at the lowest rate, the achieved rate falls "
        f"below {OPEN_MIN_ACHIEVED_SHARE:.0%} of the arrival rate, or over {OPEN_MAX_ERROR_SHARE:.0%} of arrivals fail):",
        "", "| run | knee (offered req/s) | broke at | why | best goodput (req/s) | at offered | rates measured | sweep stopped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, result in sorted(open_results.items()):
        knee = open_knee_of(result)
        best = max(result.levels, key=lambda lvl: lvl.goodput_rps, default=None)
        lines.append(
            f"| {label} | {describe_open_knee(knee)} | {'—' if not knee or knee.broke_at is None else f'{knee.broke_at:g}/s'} "
            f"| {', '.join(knee.reasons) if knee and knee.reasons else '—'} "
            f"| {_fmt(best.goodput_rps if best else None, 1)} | {'—' if best is None else f'{best.offered_rps:g}/s'} "
            f"| {', '.join(f'{lvl.offered_rps:g}' for lvl in result.levels)} | {result.stopped or '—'} |"
        )
    distributed = {label: loadgen_workers_of(r) for label, r in sorted(open_results.items()) if loadgen_workers_of(r)}
    if distributed:  # one process, the default, goes unsaid
        offered = "; ".join(f"{label}: {describe_load_generator(workers)}, each worker at 1/{workers} of the rate"
                            for label, workers in distributed.items())
        rest = "; every other run by one Locust process" if len(distributed) < len(open_results) else ""
        lines += ["", f"Load generator: {offered}{rest}."]
    rates = common_rates(open_results)
    main = {label: r for label, r in sorted(open_results.items()) if r.label == r.chapter}
    if rates and len(main) >= 2:
        lines += ["", "At the same offered rate:", "",
                  "| chapter | " + " | ".join(f"{rate:g}/s: P50 / P99 (ms), achieved" for rate in rates) + " |",
                  "|---|" + "---|" * len(rates)]
        for label, result in main.items():
            cells = []
            for rate in rates:
                level = next((lvl for lvl in result.levels if lvl.offered_rps == rate), None)
                latency = level.latency_ms if level else None
                pair = _latency_pair(latency.p50 if latency else None, latency.p99 if latency else None)
                cells.append(pair if level is None else f"{pair}, {level.qps:.1f}/s")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _calibration_cells(calibration: Calibration | None) -> list[str]:
    if calibration is None:
        return ["—"] * 6

    def get(values: Mapping[str, float | None], key: str) -> str:
        return _fmt(values.get(key), 1)

    return [get(calibration.fp32_gflops, "1"), get(calibration.fp32_gflops, "64"), get(calibration.bf16_gflops, "1"),
            get(calibration.bf16_gflops, "64"), get(calibration.engine_rps, "1"), get(calibration.engine_rps, "64")]


def render_calibration(here: Calibration | None, reference: Calibration | None, reference_name: str = "") -> list[str]:
    """This machine's calibration beside the reference's: a slower machine, or a slower server?"""
    if here is None and reference is None:
        return []
    lines = [
        "", "Machine calibration (one thread: GFLOP/s of the model's matrix shapes at 1 and 64 rows; the engine's "
        "requests/s at batch 1 and 64 with no server):", "",
        "| machine | fp32 GFLOP/s @1 | fp32 @64 | bf16 @1 | bf16 @64 | engine req/s @1 | engine @64 |",
        "|---|---|---|---|---|---|---|",
        "| these results | " + " | ".join(_calibration_cells(here)) + " |",
    ]
    if reference_name:
        lines.append(f"| reference ({reference_name}) | " + " | ".join(_calibration_cells(reference)) + " |")
    notes = []
    if here is None:
        notes.append("these results hold no calibration (recorded before it existed, or it failed).")
    if reference_name and reference is None:
        notes.append("the reference holds no calibration (recorded before it existed): re-measure it to compare machines.")
    if here is not None and reference is not None and reference_name:
        ratios = [(here.engine_rps.get(k) or 0) / v for k, v in reference.engine_rps.items() if v]
        if ratios:
            notes.append(
                f"the engine alone runs at {min(ratios):.2f}-{max(ratios):.2f}× the reference's speed here: a climb "
                f"that differs from the reference by about as much differs because of the machine, not the server."
            )
    for note in (here.bf16_note if here else None, here.error if here else None):
        if note:
            notes.append(note)
    return lines + [""] + [f"- {note}" for note in notes] if notes else lines


def render_table(
    results: Mapping[str, BenchmarkResult], chapters: Sequence[str] | None = None,
    missing_notes: Mapping[str, str] | None = None, ceiling: str = "",
    open_results: Mapping[str, OpenLoopResult] | None = None, calibration: Sequence[str] = (),
) -> str:
    """The whole markdown report: table, variants, the same-load comparisons, the open loop, where it
    ran, the calibration (lines from :func:`render_calibration`), the ceiling, warnings."""
    lines = render_rows(build_rows(results, chapters, missing_notes)) + ["", TABLE_NOTE]
    lines += render_variants(build_variant_rows(results))
    lines += render_same_load(results)
    lines += render_open_loop(open_results or {})
    lines += list(calibration)
    context = environment_line(results)
    if context:
        lines += ["", context]
    if ceiling:
        lines += ["", ceiling]
    warnings = warnings_for(results)
    if warnings:
        lines += [""] + [f"- ⚠ {w}" for w in warnings]
    return "\n".join(lines) + "\n"
