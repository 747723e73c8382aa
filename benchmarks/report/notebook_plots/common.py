"""What every notebook's figures share: finding and loading the results, showing a figure or the
note that says which command records what is missing, and small helpers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from benchmarks.harness.article import ARTICLE, BASELINE
from benchmarks.harness.results import (
    BenchmarkResult,
    LevelMeasurements,
    OpenLoopResult,
    REFERENCE_ROOT,
    REPO_ROOT,
    load_open_loop_results,
    load_results,
)


CLOSED_COMMAND = "python -m benchmarks climb --profile cpu --repeat 3"
OPEN_COMMAND = "python -m benchmarks openloop --profile cpu"
LONG_COMMAND = "python -m benchmarks climb --profile cpu --workload long --chapters ch03,ch04 --levels 1,8,32"


class MissingData(Exception):
    """The results lack what a plot needs; the message says which command records it."""


# --------------------------------------------------------------------------------------------
# Loading and showing
# --------------------------------------------------------------------------------------------


def results_dir(default_profile: str = "cpu", variable: str = "SFS_RESULTS_DIR") -> Path:
    """The notebook's results directory: ``$SFS_RESULTS_DIR``, else ``benchmarks/reference/<profile>``
    (profile from ``$SFS_PROFILE``, default ``cpu``)."""
    return Path(os.environ.get(variable) or REFERENCE_ROOT / os.environ.get("SFS_PROFILE", default_profile))


REAL_MODEL_FOLDER = "climb-smollm2"
REAL_MODEL_COMMAND = "make climb WEIGHTS=smollm2 REPEAT=1"


def real_model_dir(variable: str = "SFS_REAL_MODEL_RESULTS_DIR") -> Path:
    """The climb on the real model: ``$SFS_REAL_MODEL_RESULTS_DIR`` (your own run: ``benchmarks/results/cpu-smollm2``),
    else ``climb-smollm2/`` in the notebook's results (the committed one by default)."""
    return Path(os.environ.get(variable) or results_dir() / REAL_MODEL_FOLDER)


def load_real_model() -> dict[str, BenchmarkResult]:
    """The real model's climb results (:func:`real_model_dir`); :class:`MissingData` naming the command where there are none."""
    directory = real_model_dir()
    results = load_results(directory) if directory.exists() else {}
    if not results:
        raise MissingData(f"no climb on the real model in `{shown_path(directory)}`: `{REAL_MODEL_COMMAND}` records one "
                          f"(in `benchmarks/results/cpu-smollm2/`; point `SFS_REAL_MODEL_RESULTS_DIR` at it)")
    return results


def load_all(directory: Path) -> tuple[dict[str, BenchmarkResult], dict[str, BenchmarkResult], dict[str, OpenLoopResult]]:
    """``(default workload, long workload, open-loop sweeps)`` of ``directory``, each keyed by label."""
    return load_results(directory), load_results(directory, "long"), load_open_loop_results(directory)


def shown_path(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (a notebook never prints this machine's paths)."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def say(text: Callable[..., str], *args, **kwargs) -> None:
    """Display the markdown ``text(*args, **kwargs)`` computes from the results, or what to run where they lack its data."""
    from IPython.display import Markdown, display

    try:
        display(Markdown(text(*args, **kwargs)))
    except MissingData as missing:
        display(Markdown(f"> **No data for this plot in these results.** {missing}"))


def _draws(ax) -> bool:
    lines = [line for line in ax.lines if len(line.get_xdata()) > 0]
    return bool(lines or ax.patches or ax.collections or ax.images or ax.tables)


def empty_panels(figure: Figure) -> list[str]:
    """Titles of the visible panels on which nothing is drawn (no line, bar, collection, image or table),
    neither by the panel nor by a twin axis sharing its x (a second y scale draws on its partner's panel)."""
    return [
        ax.get_title() or "untitled panel"
        for ax in figure.axes
        if ax.get_visible() and ax.axison and not any(_draws(s) for s in ax.get_shared_x_axes().get_siblings(ax))
    ]


def check_figure(figure: Figure) -> Figure:
    """``figure`` itself; AssertionError when it has no panel or a panel with nothing drawn."""
    if not figure.axes:
        raise AssertionError("empty figure: no panel")
    empty = empty_panels(figure)
    if empty:
        raise AssertionError(f"empty panel(s): {empty}")
    return figure


def show(plot: Callable[..., Figure], *args, **kwargs) -> None:
    """Draw ``plot(*args, **kwargs)`` and display it; on :class:`MissingData` display what to run instead.

    Returns nothing, so a cell ending with ``show(...)`` displays the figure once."""
    from IPython.display import Markdown, display

    try:
        figure = plot(*args, **kwargs)
    except MissingData as missing:
        display(Markdown(f"> **No data for this plot in these results.** {missing}"))
        return
    # The titles travel with the image: `make notebooks` records them beside each README figure,
    # and a test checks every README caption against them.
    display(check_figure(figure), metadata={"figure_titles": figure_titles(figure)})


def figure_titles(figure: Figure) -> list[str]:
    """The figure's title, then each panel's, as drawn (empty ones left out)."""
    return [title for title in (figure.get_suptitle(), *(ax.get_title() for ax in figure.axes)) if title]


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def levels_of(result: BenchmarkResult) -> list:
    return sorted((lvl for lvl in result.levels if lvl.latency_ms is not None), key=lambda lvl: lvl.users)


def require_results(results: Mapping[str, BenchmarkResult], labels: Sequence[str], command: str) -> list[BenchmarkResult]:
    present = [results[label] for label in labels if label in results]
    if not present:
        raise MissingData(f"None of {', '.join(labels)} was measured here. Run: `{command}`.")
    return present


def users_axis(ax, users: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(users), [str(u) for u in users])
    ax.set_xlabel("concurrency (closed-loop users = requests in flight)")
    ax.grid(True, which="both", alpha=0.3)


def require_present(result, what: str, command: str = CLOSED_COMMAND):
    if result is None:
        raise MissingData(f"That run is not in these results ({what}). Run: `{command}`.")
    return result


def levels_with_stages(result: BenchmarkResult | OpenLoopResult | None, what: str) -> list[LevelMeasurements]:
    require_present(result, what)
    levels = [lvl for lvl in result.levels if lvl.stages_ms]
    if not levels:
        raise MissingData(
            f"`{result.label}`'s results hold no per-stage timings ({what}). "
            f"Run: `python -m benchmarks run --chapter {result.chapter} --profile {result.profile}`."
        )
    return levels


def article_line(ax, chapters: Sequence[str], measured_ratio: Mapping[str, float]) -> None:
    """A bar pair per chapter: measured speed-up over ch01 beside the article's."""
    x = np.arange(len(chapters))
    ax.bar(x - 0.2, [measured_ratio.get(c, 0) for c in chapters], 0.4, label="measured", color="tab:green")
    ax.bar(x + 0.2, [ARTICLE[c].qps / ARTICLE[BASELINE].qps if c in ARTICLE else 0 for c in chapters], 0.4,
           label="article (its GPU)", color="tab:green", alpha=0.35, hatch="//")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(x, list(chapters))
    ax.set_ylabel("QPS at saturation / ch01's")
    ax.set_title("Speed-up over ch01, beside the article's")
    ax.legend(fontsize=8)


def speedups_over_baseline(results: Mapping[str, BenchmarkResult], chapters: Sequence[str]) -> dict[str, float]:
    base = results.get(BASELINE)
    base_qps = base.saturation().qps if base and base.saturation() else None
    return {c: results[c].saturation().qps / base_qps for c in chapters if c in results and base_qps}


def repo_relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REFERENCE_ROOT.parent.parent))
    except ValueError:
        return str(path)
