"""The report: everything that reads results and draws or writes; nothing here measures.

``write_report`` below writes a results directory's climb table (markdown), ``climb.png`` and
``latency_vs_load.png``; the notebooks call the same functions. Its parts: ``knees`` (where load
stops buying throughput), ``tables`` (the markdown), ``plots`` (the figures), ``readme_blocks`` and
the ``*_blocks`` modules (the generated results blocks of every README and RESULTS.md),
``notebook_plots`` (the notebooks' figures), ``reference`` (saving a run as reference results),
``scale_out_timelines`` (reading chapter 9's timeline files), ``paths`` (how a block names a file, and
a recorded command in today's layout).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.article import ARTICLE_CHAPTERS
from benchmarks.harness.climb import chapter_is_built
from benchmarks.harness.results import (
    BenchmarkResult,
    OpenLoopResult,
    REFERENCE_ROOT,
    find_calibration,
    load_open_loop_results,
    load_results,
)

# The notebooks and a learner read the report through this package (``report.render_table``,
# ``report.plot_climb``): these are its public names, wherever they are defined.
from benchmarks.report.plots import plot_climb, plot_latency_vs_load, plot_open_loop
from benchmarks.report.tables import (
    build_rows,
    build_variant_rows,
    ceiling_line,
    environment_line,
    render_calibration,
    render_same_load,
    render_table,
)

__all__ = [
    "ReportFiles", "build_rows", "build_variant_rows", "calibration_report", "ceiling_line", "environment_line",
    "missing_chapter_notes", "plot_climb", "plot_latency_vs_load", "plot_open_loop", "render_calibration",
    "render_same_load", "render_table", "report_names", "write_report",
]


@dataclass(frozen=True)
class ReportFiles:
    table: Path
    climb_png: Path
    latency_png: Path
    markdown: str
    open_loop_png: Path | None = None  # only where open-loop sweeps exist


def calibration_report(
    directory: Path, results: Mapping[str, BenchmarkResult], open_results: Mapping[str, OpenLoopResult],
    reference_root: Path = REFERENCE_ROOT,
) -> list[str]:
    """The calibration of ``directory``'s results beside the committed reference's of the same profile
    (none beside itself when ``directory`` is that reference)."""
    everything = [*results.values(), *open_results.values()]
    here = find_calibration(everything)
    profile = everything[0].config.profile if everything else Path(directory).name
    reference_dir = Path(reference_root) / profile
    if not reference_dir.exists() or Path(directory).resolve() == reference_dir.resolve():
        return render_calibration(here, None)
    reference = find_calibration([*load_results(reference_dir).values(), *load_open_loop_results(reference_dir).values()])
    return render_calibration(here, reference, f"benchmarks/reference/{profile}")


def report_names(workload: str) -> tuple[str, str, str]:
    suffix = "" if workload == "default" else f"-{workload}"
    return f"climb{suffix}.md", f"climb{suffix}.png", f"latency_vs_load{suffix}.png"


def missing_chapter_notes(chapters: Sequence[str]) -> dict[str, str]:
    """Why each chapter has no figures: not built yet, or built but not measured in this directory."""
    return {chapter: ("not measured" if chapter_is_built(chapter) else "not built yet") for chapter in chapters}


def write_report(directory: Path, workload: str = "default", extra_notes: Mapping[str, str] | None = None) -> ReportFiles:
    """Read every result of ``workload`` in ``directory``; write the table and both plots there."""
    directory = Path(directory)
    results = load_results(directory, workload)
    open_results = load_open_loop_results(directory, workload)
    order = sorted(set(ARTICLE_CHAPTERS) | {r.chapter for r in results.values()})
    notes = {**missing_chapter_notes(order), **(extra_notes or {})}
    markdown = render_table(results, order, notes, ceiling_line(directory), open_results,
                            calibration_report(directory, results, open_results))
    table_name, climb_name, latency_name = report_names(workload)
    profile = next(iter(results.values())).config.profile if results else directory.name
    (directory / table_name).write_text(f"# The climb: profile `{profile}`, workload `{workload}`\n\n{markdown}")

    rows = build_rows(results, order, notes)
    variants = [row for row, _ratio in build_variant_rows(results)]
    climb_figure = plot_climb(rows, title=f"The climb ({profile} profile) beside the article's", variants=variants)
    climb_figure.savefig(directory / climb_name, dpi=120)
    latency_figure = plot_latency_vs_load(results, title=f"Latency against load ({profile} profile)")
    latency_figure.savefig(directory / latency_name, dpi=120)
    open_png = None
    if open_results:
        open_png = directory / latency_name.replace("latency_vs_load", "openloop")
        plot_open_loop(open_results, title=f"Open loop ({profile} profile)").savefig(open_png, dpi=120)
    return ReportFiles(directory / table_name, directory / climb_name, directory / latency_name, markdown, open_png)


def results_dir_from_env(default: Path) -> Path:
    """The notebooks' results directory: ``SFS_RESULTS_DIR`` when set (tests point it at synthetic data)."""
    return Path(os.environ.get("SFS_RESULTS_DIR", default))
