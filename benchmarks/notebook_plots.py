"""The chapter notebooks' figures: each plot reads results (never measures) and returns a matplotlib Figure.

A plot whose data the results do not hold (a file written before the harness recorded stage
timings, batch sizes or open-loop sweeps) raises :class:`MissingData`, whose message names the
command that produces the data; :func:`show` turns that into a note in the notebook instead of an
empty figure, and refuses to display a figure with an empty panel (the notebooks' test relies on it).

Figures are :class:`matplotlib.figure.Figure` objects (no pyplot state), as in :mod:`benchmarks.report`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from itertools import product
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from benchmarks.article import ARTICLE, BASELINE
from benchmarks.report import describe_open_knee, open_knee_of
from benchmarks.results import (
    REFERENCE_ROOT,
    REPO_ROOT,
    BenchmarkResult,
    LevelMeasurements,
    OpenLoopResult,
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


def _levels(result: BenchmarkResult) -> list:
    return sorted((lvl for lvl in result.levels if lvl.latency_ms is not None), key=lambda lvl: lvl.users)


def _require(results: Mapping[str, BenchmarkResult], labels: Sequence[str], command: str) -> list[BenchmarkResult]:
    present = [results[label] for label in labels if label in results]
    if not present:
        raise MissingData(f"None of {', '.join(labels)} was measured here. Run: `{command}`.")
    return present


def _users_axis(ax, users: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(users), [str(u) for u in users])
    ax.set_xlabel("concurrency (closed-loop users = requests in flight)")
    ax.grid(True, which="both", alpha=0.3)


def _present(result, what: str, command: str = CLOSED_COMMAND):
    if result is None:
        raise MissingData(f"That run is not in these results ({what}). Run: `{command}`.")
    return result


def _with_stages(result: BenchmarkResult | OpenLoopResult | None, what: str) -> list[LevelMeasurements]:
    _present(result, what)
    levels = [lvl for lvl in result.levels if lvl.stages_ms]
    if not levels:
        raise MissingData(
            f"`{result.label}`'s results hold no per-stage timings ({what}); they were recorded before the harness "
            f"kept them. Run: `python -m benchmarks run --chapter {result.chapter} --profile {result.profile}`."
        )
    return levels


def _article_line(ax, chapters: Sequence[str], measured_ratio: Mapping[str, float]) -> None:
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


def _ratios(results: Mapping[str, BenchmarkResult], chapters: Sequence[str]) -> dict[str, float]:
    base = results.get(BASELINE)
    base_qps = base.saturation().qps if base and base.saturation() else None
    return {c: results[c].saturation().qps / base_qps for c in chapters if c in results and base_qps}


# --------------------------------------------------------------------------------------------
# Chapter 1: the queue nobody shows
# --------------------------------------------------------------------------------------------


def plot_queue_nobody_shows(results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch01", "ch01-workers")):
    """P50 against concurrency beside ``users x`` the one-user P50: a server that serves one request at
    a time makes the n-th client wait for the n-1 before it, and none of that wait is on the server's clock."""
    runs = _require(results, labels, CLOSED_COMMAND)
    ax = Figure(figsize=(7, 4.5)).subplots()
    for n, result in enumerate(runs):
        levels = _levels(result)
        users = [lvl.users for lvl in levels]
        ax.plot(users, [lvl.latency_ms.p50 for lvl in levels], "o-", color=f"C{n}", label=f"{result.label}: P50 measured")
        alone = levels[0].latency_ms.p50 / levels[0].users
        ax.plot(users, [u * alone for u in users], ":", color=f"C{n}",
                label=f"{result.label}: users × P50 alone (a pure queue)")
    _users_axis(ax, sorted({lvl.users for r in runs for lvl in r.levels}))
    ax.set_yscale("log")
    ax.set_ylabel("latency the client sees (ms)")
    ax.set_title("Chapter 1: latency grows like a queue")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def plot_client_vs_server(result: BenchmarkResult):
    """Per level: the P50 time the client saw beside the server's own ``total`` and compute P50 (left);
    every sampled request's client time against its server time (right). The gap is time spent
    outside the server's clock: in the kernel's accept backlog (chapter 1) or the event loop."""
    levels = [lvl for lvl in _with_stages(result, "client against server time") if lvl.samples]
    left, right = Figure(figsize=(13, 4.5)).subplots(1, 2)
    x = np.arange(len(levels))
    compute_stage = next((s for s in ("inference", "batch") if s in levels[0].stages_ms), None)
    left.bar(x - 0.27, [lvl.latency_ms.p50 for lvl in levels], 0.27, label="client sees (P50)")
    left.bar(x, [lvl.stages_ms["total"].p50 if "total" in lvl.stages_ms else 0 for lvl in levels], 0.27,
             label="server's total (P50)")
    if compute_stage:
        left.bar(x + 0.27, [lvl.stages_ms[compute_stage].p50 for lvl in levels], 0.27,
                 label=f"server computing: {compute_stage} (P50)")
    left.set_xticks(x, [str(getattr(lvl, "users", "")) for lvl in levels])
    left.set_xlabel("concurrency (users)")
    left.set_ylabel("ms")
    left.set_yscale("log")
    left.set_title(f"{result.label}: what the client sees against what the server counts")
    left.legend(fontsize=8)
    for lvl in levels:
        totals = lvl.samples.stages_ms.get("total")
        if not totals:
            continue
        pairs = [(c, s) for c, s in zip(lvl.samples.latency_ms, totals) if s is not None]
        right.scatter([s for _, s in pairs], [c for c, _ in pairs], s=6, alpha=0.5, label=f"{lvl.users} users")
    top = max((max(lvl.samples.latency_ms) for lvl in levels), default=1.0)
    right.plot([0.1, top], [0.1, top], ":", color="gray", label="client = server")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("server's own total (ms)")
    right.set_ylabel("time the client saw (ms)")
    right.set_title("Each sampled request: above the diagonal = unseen waiting")
    right.legend(fontsize=8)
    left.figure.tight_layout()
    return left.figure


# --------------------------------------------------------------------------------------------
# Chapter 2: sync against async, and where one request's time goes
# --------------------------------------------------------------------------------------------


def plot_latency_and_qps(results: Mapping[str, BenchmarkResult], labels: Sequence[str], title: str):
    """P50 and P99 (left, log) and QPS (middle) against concurrency for ``labels``; speed-up beside the article's (right)."""
    runs = _require(results, labels, CLOSED_COMMAND)
    latency_ax, qps_ax, ratio_ax = Figure(figsize=(16, 4.5)).subplots(1, 3)
    for n, result in enumerate(runs):
        levels = _levels(result)
        users = [lvl.users for lvl in levels]
        color = f"C{n}"
        latency_ax.plot(users, [lvl.latency_ms.p50 for lvl in levels], "o-", color=color, label=f"{result.label} P50")
        latency_ax.plot(users, [lvl.latency_ms.p99 for lvl in levels], "s--", color=color, label=f"{result.label} P99")
        qps_ax.plot(users, [lvl.qps for lvl in levels], "o-", color=color, label=result.label)
    all_users = sorted({lvl.users for r in runs for lvl in r.levels})
    for ax in (latency_ax, qps_ax):
        _users_axis(ax, all_users)
        ax.legend(fontsize=8)
    latency_ax.set_yscale("log")
    latency_ax.set_ylabel("latency (ms)")
    latency_ax.set_title("Latency against load")
    qps_ax.set_ylabel("QPS (successful requests/s)")
    qps_ax.set_ylim(bottom=0)
    qps_ax.set_title("Throughput against load")
    chapters = [c for c in labels if c in ARTICLE]
    _article_line(ratio_ax, chapters, _ratios(results, chapters))
    latency_ax.figure.suptitle(title)
    latency_ax.figure.tight_layout()
    return latency_ax.figure


def plot_stage_breakdown(result: BenchmarkResult | OpenLoopResult):
    """Stacked P50 of each server stage per level (``total`` and stages that contain others left out),
    beside the client's P50: where one request's time goes as the load grows."""
    levels = _with_stages(result, "where the time goes")
    contained = {"total", "batch"}  # batch = prefill + decode; total = everything
    stages = [s for s in levels[-1].stages_ms if s not in contained]
    stages = sorted(set(stages) | {s for lvl in levels for s in lvl.stages_ms if s not in contained},
                    key=lambda s: ["parse", "admission", "queue", "prefill", "decode", "inference", "fallback"].index(s)
                    if s in ("parse", "admission", "queue", "prefill", "decode", "inference", "fallback") else 99)
    ax = Figure(figsize=(8, 4.5)).subplots()
    x = np.arange(len(levels))
    bottom = np.zeros(len(levels))
    for stage in stages:
        heights = np.array([lvl.stages_ms[stage].p50 if stage in lvl.stages_ms else 0.0 for lvl in levels])
        ax.bar(x, heights, 0.6, bottom=bottom, label=stage)
        bottom += heights
    ax.plot(x, [lvl.latency_ms.p50 for lvl in levels], "k_", markersize=30, markeredgewidth=2,
            label="client's P50 latency")
    names = [str(getattr(lvl, "users", None) or f"{getattr(lvl, 'offered_rps', 0):g}/s") for lvl in levels]
    ax.set_xticks(x, names)
    ax.set_xlabel("concurrency (users)" if hasattr(levels[0], "users") else "offered rate (requests/s)")
    ax.set_ylabel("P50 per stage (ms, stacked)")
    ax.set_title(f"{result.label}: where one request's time goes (server's timings_ms)")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


# --------------------------------------------------------------------------------------------
# Chapter 3: batch sizes, padding, the window's trade-off
# --------------------------------------------------------------------------------------------


def _with_batches(result: BenchmarkResult | None) -> list:
    _present(result, "batch sizes")
    levels = [lvl for lvl in result.levels if lvl.server_series and lvl.server_series.batch_sizes]
    if not levels:
        raise MissingData(
            f"`{result.label}`'s results hold no batch sizes (recorded before the harness polled `/stats`). "
            f"Run: `python -m benchmarks run --chapter {result.chapter} --profile {result.profile}`."
        )
    return levels


def plot_batch_sizes(result: BenchmarkResult):
    """The batch-size distribution per level, as the server counted it (share of requests in batches of each size)."""
    levels = _with_batches(result)
    ax = Figure(figsize=(9, 4.5)).subplots()
    for lvl in levels:
        sizes = sorted((int(size), count) for size, count in lvl.server_series.batch_sizes.items())
        requests = sum(size * count for size, count in sizes)
        # points only: a line between two sizes would draw batch sizes that never occurred
        ax.plot([s for s, _ in sizes], [100 * s * c / requests for s, c in sizes], "o", markersize=5, alpha=0.8,
                label=f"{lvl.users} users (mean batch {requests / sum(c for _, c in sizes):.1f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests computed together)")
    ax.set_ylabel("share of requests (%)")
    ax.set_title(f"{result.label}: the batch sizes the server formed")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def expected_padding(batch_sizes: Mapping[str, int], prompt_lengths: Sequence[int]) -> tuple[float, float]:
    """``(prompt tokens computed, prompt tokens needed)`` per level, expected over the workload's mix.

    A left-padded batch of ``b`` prompts computes ``b x`` the longest one; it needs the sum of their
    lengths. With lengths drawn uniformly from ``prompt_lengths`` (independently), the longest of
    ``b`` has P(max <= L) = (share of lengths <= L) ** b; both expectations are exact for that draw.
    """
    lengths = sorted(prompt_lengths)
    mean = float(np.mean(lengths))
    computed = needed = 0.0
    for size_text, count in batch_sizes.items():
        b = int(size_text)
        cdf = [((i + 1) / len(lengths)) ** b for i in range(len(lengths))]
        expected_max = sum(length * (cdf[i] - (cdf[i - 1] if i else 0.0)) for i, length in enumerate(lengths))
        computed += count * b * expected_max
        needed += count * b * mean
    return computed, needed


CH03_DEFAULT_PREFILL = "by_length"  # chapter 3's --prefill default (a test holds the two equal)


def prefill_mode(result: BenchmarkResult) -> str:
    """The ``--prefill`` a chapter 3 run used: its server flags, else ``SFS_PREFILL``, else the default."""
    args = list(result.config.server_args)
    for i, arg in enumerate(args):
        if arg.startswith("--prefill="):
            return arg.split("=", 1)[1]
        if arg == "--prefill" and i + 1 < len(args):
            return args[i + 1]
    return result.environment.thread_env.get("SFS_PREFILL", CH03_DEFAULT_PREFILL)


def plot_padding(result: BenchmarkResult):
    """Prompt tokens of each level's prompt passes: what the requests need (sum of their lengths), what a
    padded pass computes (batch x longest prompt, expected from the measured batch sizes and the
    workload's length mix), and what this run's pass computed, which depends on its ``--prefill``:
    ``padded`` computes the padding, ``by_length`` only what is needed."""
    levels = _with_batches(result)
    mode = prefill_mode(result)
    ax = Figure(figsize=(8, 4.5)).subplots()
    x = np.arange(len(levels))
    pairs = [expected_padding(lvl.server_series.batch_sizes, result.config.prompt_lengths) for lvl in levels]
    ax.bar(x - 0.2, [n for _, n in pairs], 0.4, color="C0", label="needed (sum of prompt lengths)")
    ax.bar(x + 0.2, [c for c, _ in pairs], 0.4, color="C1", alpha=0.9 if mode == "padded" else 0.35,
           hatch=None if mode == "padded" else "//",
           label="a padded pass (batch x longest prompt)" + ("" if mode == "padded" else ": not this run's"))
    for i, (padded, needed) in enumerate(pairs):
        share = 100 * (1 - needed / padded)
        note = f"{share:.0f}% padding computed" if mode == "padded" else f"0% computed ({share:.0f}% if padded)"
        ax.annotate(note, (i, padded), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [str(lvl.users) for lvl in levels])
    ax.set_xlabel("concurrency (users)")
    ax.set_ylabel("prompt tokens over the level (expected)")
    ax.set_title(f"{result.label} (--prefill {mode}): prompt tokens computed against needed")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def window_cost(results: Mapping[str, BenchmarkResult], before: str = "ch02", after: str = "ch03") -> str:
    """What the data say the batching chapter costs one request alone: the P50 at the lowest load of both,
    and how the batching chapter's server stages split it (markdown)."""
    runs = _require(results, (before, after), CLOSED_COMMAND)
    if len(runs) < 2:
        raise MissingData(f"Both {before} and {after} are needed. Run: `{CLOSED_COMMAND}`.")
    first, second = (min(_levels(r), key=lambda lvl: lvl.users) for r in runs)
    if first.users != second.users:
        raise MissingData(f"{before} and {after} have no load level in common. Run: `{CLOSED_COMMAND}`.")
    def stages(level) -> str:
        return ", ".join(f"`{name}` {figures.p50:,.0f} ms" for name, figures in (level.stages_ms or {}).items()) or "not recorded"

    gap = second.latency_ms.p50 - first.latency_ms.p50
    return (f"At {first.users} user(s): {before}'s P50 is {first.latency_ms.p50:,.0f} ms, {after}'s "
            f"{second.latency_ms.p50:,.0f} ms ({gap:+,.0f} ms). The server's own stages (P50 each): {after}: "
            f"{stages(second)}; {before}: {stages(first)}.")


def plot_window_tradeoff(results: Mapping[str, BenchmarkResult], before: str = "ch02", after: str = "ch03"):
    """The batching window's trade-off: what it costs alone (P50 at the lowest load, and the ``queue``
    stage where recorded) against what it buys under load (QPS at each level)."""
    runs = _require(results, (before, after), CLOSED_COMMAND)
    latency_ax, qps_ax = Figure(figsize=(12, 4.5)).subplots(1, 2)
    for n, result in enumerate(runs):
        levels = _levels(result)
        users = [lvl.users for lvl in levels]
        latency_ax.plot(users, [lvl.latency_ms.p50 for lvl in levels], "o-", color=f"C{n}", label=f"{result.label} P50")
        queued = [(lvl.users, lvl.stages_ms["queue"].p50) for lvl in levels if lvl.stages_ms and "queue" in lvl.stages_ms]
        if queued:
            latency_ax.plot(*zip(*queued, strict=True), "^:", color=f"C{n}", label=f"{result.label}: queue stage P50")
        qps_ax.plot(users, [lvl.qps for lvl in levels], "o-", color=f"C{n}", label=result.label)
    users = sorted({lvl.users for r in runs for lvl in r.levels})
    for ax in (latency_ax, qps_ax):
        _users_axis(ax, users)
        ax.legend(fontsize=8)
    latency_ax.set_yscale("log")
    latency_ax.set_ylabel("ms")
    latency_ax.set_title("Cost: latency (the window waits for company)")
    qps_ax.set_ylabel("QPS")
    qps_ax.set_ylim(bottom=0)
    qps_ax.set_title("Gain: throughput under load")
    latency_ax.figure.suptitle(f"The batching window: {before} against {after}")
    latency_ax.figure.tight_layout()
    return latency_ax.figure


# --------------------------------------------------------------------------------------------
# Chapter 4: the pool
# --------------------------------------------------------------------------------------------


def plot_step_time(long_results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch03", "ch04")):
    """Decode time per generated token against the prompt's length (``long`` workload, at the lowest load
    measured: one request at a time where 1 user was measured), ``torch.cat`` cache (chapter 3) against
    the pre-allocated pool (chapter 4)."""
    runs = _require(long_results, labels, LONG_COMMAND)
    ax = Figure(figsize=(8, 4.5)).subplots()
    drawn = False
    for n, result in enumerate(runs):
        level = min(result.levels, key=lambda lvl: lvl.users)
        samples = level.samples
        if samples is None or "decode" not in samples.stages_ms:
            continue
        by_length: dict[int, list[float]] = {}
        for length, decode in zip(samples.prompt_tokens, samples.stages_ms["decode"], strict=True):
            if length is not None and decode is not None:
                by_length.setdefault(length, []).append(decode / result.config.max_new_tokens)
        lengths = sorted(by_length)
        ax.scatter([length for length in lengths for _ in by_length[length]],
                   [v for length in lengths for v in by_length[length]], s=8, alpha=0.4, color=f"C{n}")
        ax.plot(lengths, [np.median(by_length[length]) for length in lengths], "o-", color=f"C{n}",
                label=f"{result.label} at {level.users} user(s): median")
        drawn = True
    if not drawn:
        raise MissingData(f"No per-request decode timings in the long-workload results. Run: `{LONG_COMMAND}`.")
    ax.set_xlabel("prompt length (tokens); each request then decodes max_new_tokens more")
    ax.set_ylabel("decode time per generated token (ms)")
    ax.set_title("Per-step time against sequence length: torch.cat cache vs pool")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def plot_long_workload(long_results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch03", "ch04")):
    """The long workload (256 new tokens): tokens/s and P99 against concurrency, chapter 3 against chapter 4."""
    runs = _require(long_results, labels, LONG_COMMAND)
    tokens_ax, p99_ax = Figure(figsize=(12, 4.5)).subplots(1, 2)
    for n, result in enumerate(runs):
        levels = _levels(result)
        users = [lvl.users for lvl in levels]
        tokens_ax.plot(users, [lvl.tokens_per_s for lvl in levels], "o-", color=f"C{n}", label=result.label)
        p99_ax.plot(users, [lvl.latency_ms.p99 for lvl in levels], "o-", color=f"C{n}", label=result.label)
    users = sorted({lvl.users for r in runs for lvl in r.levels})
    for ax in (tokens_ax, p99_ax):
        _users_axis(ax, users)
        ax.legend(fontsize=8)
    tokens_ax.set_ylabel("generated tokens/s")
    tokens_ax.set_title("Throughput, long workload")
    p99_ax.set_ylabel("P99 latency (ms)")
    p99_ax.set_yscale("log")
    p99_ax.set_title("P99, long workload")
    tokens_ax.figure.tight_layout()
    return tokens_ax.figure


def long_workload_ratios(long_results: Mapping[str, BenchmarkResult], before: str = "ch03", after: str = "ch04") -> str:
    """``after``'s generated tokens/s over ``before``'s at every load both measured on the ``long`` workload (markdown)."""
    runs = _require(long_results, (before, after), LONG_COMMAND)
    if len(runs) < 2:
        raise MissingData(f"Both {before} and {after} are needed on the long workload. Run: `{LONG_COMMAND}`.")
    first, second = ({lvl.users: lvl for lvl in _levels(r)} for r in runs)
    shared = sorted(set(first) & set(second))
    if not shared:
        raise MissingData(f"{before} and {after} have no load level in common. Run: `{LONG_COMMAND}`.")
    cells = ", ".join(f"{users} user(s): {second[users].tokens_per_s / first[users].tokens_per_s:.2f}×" for users in shared)
    return f"Long workload, {after}'s generated tokens/s over {before}'s at the same load: {cells}."


POOL_SERIES = {  # figure name in /stats -> (label, scale to %)
    "pool.use": ("pool blocks in use (%)", 100.0),
    "pool.written_share": ("reserved KV slots actually written (%)", 100.0),
    "admission.reserved_use": ("pool reserved by admission (%)", 100.0),
}


def _series_value(point: Mapping[str, float], constants: Mapping[str, float], name: str) -> float | None:
    return point.get(name, constants.get(name))


def plot_pool_over_time(result: BenchmarkResult):
    """The pool's figures (as ``/stats`` reported them every half second) over each level's time:
    blocks in use, the share of reserved slots written, admission's reservation."""
    _present(result, "the pool over time")
    levels = [lvl for lvl in result.levels if lvl.server_series and lvl.server_series.points]
    names = [name for name in POOL_SERIES
             if any(_series_value(p, lvl.server_series.constants, name) is not None
                    for lvl in levels for p in lvl.server_series.points)]
    if not levels or not names:
        raise MissingData(
            f"`{result.label}`'s results hold no pool figures over time (recorded before the harness polled "
            f"`/stats`). Run: `python -m benchmarks run --chapter {result.chapter} --profile {result.profile}`."
        )
    axes = Figure(figsize=(6 * len(names), 4.2)).subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        label, scale = POOL_SERIES[name]
        for lvl in levels:
            points = [(p["t_s"], _series_value(p, lvl.server_series.constants, name)) for p in lvl.server_series.points]
            points = [(t, v * scale) for t, v in points if v is not None]
            if points:
                ax.plot(*zip(*points, strict=True), ".-", label=f"{lvl.users} users")
        ax.set_xlabel("seconds from the level's measuring window")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].figure.suptitle(f"{result.label}: the KV pool under load")
    axes[0].figure.tight_layout()
    return axes[0].figure


def plot_rejections(results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch04", "ch05", "ch06")):
    """Per level: 429 answers (the queue was full) and, where recorded, requests served on the fallback path."""
    runs = _require(results, labels, CLOSED_COMMAND)
    ax = Figure(figsize=(9, 4.5)).subplots()
    users = sorted({lvl.users for r in runs for lvl in r.levels})
    width = 0.8 / (2 * len(runs))
    for n, result in enumerate(runs):
        x = np.arange(len(users))
        rejected = [(result.level(u).errors_by_status.get("429", 0) if result.level(u) else 0) for u in users]
        ax.bar(x + (2 * n) * width - 0.4, rejected, width, color=f"C{n}", label=f"{result.label}: 429 answers")
        fallback = []
        for u in users:
            level = result.level(u)
            points = level.server_series.points if level and level.server_series else []
            served = [p.get("admission.fallback_served_total") for p in points if "admission.fallback_served_total" in p]
            fallback.append(served[-1] - served[0] if len(served) >= 2 else 0)
        ax.bar(x + (2 * n + 1) * width - 0.4, fallback, width, color=f"C{n}", alpha=0.4, hatch="//",
               label=f"{result.label}: served on the fallback")
    ax.set_xticks(np.arange(len(users)), [str(u) for u in users])
    ax.set_xlabel("concurrency (users)")
    ax.set_ylabel("requests in the level")
    ax.set_title("Admission control: rejected (429) and offloaded requests")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


# --------------------------------------------------------------------------------------------
# Chapter 5: accuracy against throughput
# --------------------------------------------------------------------------------------------


def load_tradeoffs(path: Path | None = None) -> dict:
    """Chapter 5's trade-off table (``python -m benchmarks.tradeoffs --save-reference``)."""
    path = Path(path or os.environ.get("SFS_TRADEOFFS_FILE") or REFERENCE_ROOT / "ch05-tradeoffs" / "latest.json")
    if not path.exists():
        raise MissingData(f"No trade-off table at {path}. Run: "
                          f"`python -m benchmarks.tradeoffs --save-reference`.")
    return json.loads(path.read_text())


def plot_tradeoffs(table: Mapping):
    """Every available engine x precision: held-out accuracy against batch throughput (left) and
    against the one-request latency (right)."""
    rows = [row for row in table.get("rows", []) if row.get("available") and row.get("throughput_tok_s")]
    if not rows:
        raise MissingData("The trade-off table has no measured rows. Run: "
                          "`python -m benchmarks.tradeoffs --save-reference`.")
    throughput_ax, latency_ax = Figure(figsize=(13, 4.8)).subplots(1, 2)
    markers = dict(zip(sorted({r["engine"] for r in rows}), "osD^vP*X"))
    for n, precision in enumerate(sorted({r["precision"] for r in rows})):
        for row in (r for r in rows if r["precision"] == precision):
            for ax, key in ((throughput_ax, "throughput_tok_s"), (latency_ax, "latency_b1_ms")):
                if row.get(key) is None:
                    continue
                ax.scatter(row[key], 100 * row["accuracy"], color=f"C{n}", marker=markers[row["engine"]], s=50)
                ax.annotate(f"{row['engine']} {precision}", (row[key], 100 * row["accuracy"]), fontsize=7,
                            xytext=(4, 3), textcoords="offset points")
    throughput_ax.set_xlabel(f"throughput at batch {table.get('config', {}).get('batch', '?')} (generated tokens/s)")
    latency_ax.set_xlabel("latency of one request alone (ms)")
    for ax in (throughput_ax, latency_ax):
        ax.set_ylabel("held-out arithmetic accuracy (%)")
        ax.grid(True, alpha=0.3)
    throughput_ax.set_title("Accuracy against throughput (up and right is better)")
    latency_ax.set_title("Accuracy against latency (up and left is better)")
    throughput_ax.figure.suptitle(f"Chapter 5's trade-offs on {table.get('environment', {}).get('device', '?')}")
    throughput_ax.figure.tight_layout()
    return throughput_ax.figure


# --------------------------------------------------------------------------------------------
# Chapter 6: the tuner's sweep, the adaptive window
# --------------------------------------------------------------------------------------------


def load_tuned(path: Path | None = None) -> dict:
    path = Path(path or os.environ.get("SFS_TUNED_FILE") or
                REFERENCE_ROOT.parent.parent / "chapters" / "ch06_tuned_batching" / "tuned.json")
    if not path.exists():
        raise MissingData(f"No tuner results at {path}. Run: `python -m benchmarks.autotune --profile cpu`.")
    return json.loads(path.read_text())


def plot_tuner_heatmap(tuned: Mapping):
    """The autotuner's trials: QPS for every (max_batch, min_batch) x window, the chosen one framed."""
    trials = [t for t in tuned.get("trials", []) if t.get("qps") is not None]
    if not trials:
        raise MissingData("The tuner's file holds no trials. Run: `python -m benchmarks.autotune`.")
    rows = sorted({(t["max_batch"], t["min_batch"]) for t in trials})
    windows = sorted({t["window_ms"] for t in trials})
    grid = np.full((len(rows), len(windows)), np.nan)
    p99 = np.full_like(grid, np.nan)
    for t in trials:
        i, j = rows.index((t["max_batch"], t["min_batch"])), windows.index(t["window_ms"])
        grid[i, j], p99[i, j] = t["qps"], t.get("p99_ms") or np.nan
    ax = Figure(figsize=(2 + 1.6 * len(windows), 1.5 + 0.55 * len(rows))).subplots()
    image = ax.imshow(grid, cmap="viridis", aspect="auto")
    for i, j in product(range(len(rows)), range(len(windows))):
        if not np.isnan(grid[i, j]):
            ax.text(j, i, f"{grid[i, j]:.0f} QPS\nP99 {p99[i, j]:.0f} ms", ha="center", va="center", fontsize=7,
                    color="white" if grid[i, j] < np.nanmean(grid) else "black")
    chosen = tuned.get("chosen") or {}
    if chosen and (chosen.get("max_batch"), chosen.get("min_batch")) in rows and chosen.get("window_ms") in windows:
        i, j = rows.index((chosen["max_batch"], chosen["min_batch"])), windows.index(chosen["window_ms"])
        ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
            (j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(windows)), [f"{w:g}" for w in windows])
    ax.set_yticks(range(len(rows)), [f"max {b}, min {m}" for b, m in rows])
    ax.set_xlabel("batching window (ms)")
    ax.set_ylabel("batch limits")
    users = ", ".join(map(str, tuned.get("levels", []))) or "?"
    ax.set_title(f"The tuner's sweep at {users} users ({tuned.get('profile', '?')}): QPS, chosen framed red")
    ax.figure.colorbar(image, ax=ax, label="QPS")
    ax.figure.tight_layout()
    return ax.figure


def plot_one_user_latency(results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch05", "ch06")):
    """The latency of one request alone (the lowest load) with a fixed window (chapter 5) and the
    adaptive one (chapter 6): P50/P99 bars, and the sampled distribution where recorded."""
    runs = _require(results, labels, CLOSED_COMMAND)
    bars_ax, cdf_ax = Figure(figsize=(12, 4.5)).subplots(1, 2)
    x = np.arange(len(runs))
    lowest = [min(r.levels, key=lambda lvl: lvl.users) for r in runs]
    bars_ax.bar(x - 0.2, [lvl.latency_ms.p50 for lvl in lowest], 0.4, label="P50")
    bars_ax.bar(x + 0.2, [lvl.latency_ms.p99 for lvl in lowest], 0.4, label="P99")
    bars_ax.set_xticks(x, [f"{r.label}\n({lvl.users} user)" for r, lvl in zip(runs, lowest, strict=True)])
    bars_ax.set_ylabel("latency (ms)")
    bars_ax.set_title("One user: fixed window against adaptive window")
    bars_ax.legend(fontsize=8)
    drawn = False
    for n, (result, level) in enumerate(zip(runs, lowest, strict=True)):
        if level.samples and level.samples.latency_ms:
            values = np.sort(level.samples.latency_ms)
            cdf_ax.plot(values, 100 * np.arange(1, len(values) + 1) / len(values), color=f"C{n}", label=result.label)
            drawn = True
    if drawn:
        cdf_ax.set_xlabel("latency (ms)")
        cdf_ax.set_ylabel("requests answered within (%)")
        cdf_ax.set_title("Distribution at one user (sampled requests)")
        cdf_ax.grid(True, alpha=0.3)
        cdf_ax.legend(fontsize=8)
    else:
        cdf_ax.set_visible(False)
    bars_ax.figure.tight_layout()
    return bars_ax.figure


# --------------------------------------------------------------------------------------------
# The climb: CPU beside GPU, the knees
# --------------------------------------------------------------------------------------------


def plot_cpu_gpu_article(cpu: Mapping[str, BenchmarkResult], gpu: Mapping[str, BenchmarkResult]):
    """Speed-up over ch01 per chapter: the CPU reference, the GPU reference and the article, side by side."""
    chapters = sorted(set(ARTICLE) | {r.chapter for r in (*cpu.values(), *gpu.values()) if r.label == r.chapter})
    if not cpu and not gpu:
        raise MissingData(f"No closed-loop results. Run: `{CLOSED_COMMAND}`.")
    ax = Figure(figsize=(11, 4.5)).subplots()
    x = np.arange(len(chapters))
    for offset, (name, ratios, style) in zip((-0.27, 0.0, 0.27), (
        ("CPU reference", _ratios(cpu, chapters), {"color": "tab:blue"}),
        ("GPU reference", _ratios(gpu, chapters), {"color": "tab:orange"}),
        ("article", {c: ARTICLE[c].qps / ARTICLE[BASELINE].qps for c in chapters if c in ARTICLE},
         {"color": "gray", "alpha": 0.5, "hatch": "//"}),
    ), strict=True):
        ax.bar(x + offset, [ratios.get(c, 0) for c in chapters], 0.27, label=name, **style)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(x, chapters)
    ax.set_ylabel("QPS at saturation / ch01's")
    ax.set_title("The climb's shape: CPU and GPU references beside the article")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def plot_knees(open_results: Mapping[str, OpenLoopResult]):
    """Per chapter: the open-loop knee (the highest offered rate still in the linear regime) and the
    best goodput, in requests/s."""
    main = {label: r for label, r in sorted(open_results.items()) if r.label == r.chapter}
    if not main:
        raise MissingData(f"No open-loop sweep in these results. Run: `{OPEN_COMMAND}`.")
    ax = Figure(figsize=(9, 4.5)).subplots()
    x = np.arange(len(main))
    knees = [open_knee_of(r) for r in main.values()]
    ax.bar(x - 0.2, [(k.rate or 0) if k else 0 for k in knees], 0.4, label="knee: last offered rate in the linear regime")
    ax.bar(x + 0.2, [max((lvl.goodput_rps for lvl in r.levels), default=0) for r in main.values()], 0.4,
           label=f"best goodput (within {next(iter(main.values())).config.slo_ms:,.0f} ms)")
    for i, knee in enumerate(knees):
        ax.annotate(describe_open_knee(knee), (i - 0.2, (knee.rate or 0) if knee else 0), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(x, list(main))
    ax.set_ylabel("requests/s")
    ax.set_title("Where each chapter's latency leaves its linear regime (open loop)")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def require_open_loop(open_results: Mapping[str, OpenLoopResult]) -> Mapping[str, OpenLoopResult]:
    if not open_results:
        raise MissingData(f"No open-loop sweep in these results. Run: `{OPEN_COMMAND}`.")
    return open_results


# --------------------------------------------------------------------------------------------
# Chapter 7: the drain around a SIGTERM, the leak check's memory curve
# --------------------------------------------------------------------------------------------

PRODUCTION_DIR = "ch07"  # under the results directory
DRAIN_FILE = "drain-timeline.json"
LEAK_LESSONS = ("leaky", "fixed")


def _relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REFERENCE_ROOT.parent.parent))
    except ValueError:
        return str(path)


def drain_command(directory: Path) -> str:
    return f"python -m benchmarks.drain_timeline --out {_relative(Path(directory) / PRODUCTION_DIR / DRAIN_FILE)}"


def leak_command(directory: Path, lesson: str) -> str:
    out = _relative(Path(directory) / PRODUCTION_DIR / f"leak-{lesson}.json")
    return (f"python -m chapters.ch07_production.leakcheck --requests 2000 --fail-share 0.2 --samples 20 "
            f"--leak-lesson {lesson} --out {out}")


def load_drain_timeline(directory: Path) -> dict:
    """The recorder's timeline (``benchmarks/drain_timeline.py``) in ``directory/ch07/``."""
    path = Path(directory) / PRODUCTION_DIR / DRAIN_FILE
    if not path.exists():
        raise MissingData(f"No drain timeline at {path}. Run: `{drain_command(directory)}`.")
    return json.loads(path.read_text())


def load_leak_curves(directory: Path) -> dict[str, dict]:
    """The leak check's reports with their memory curve, keyed by lesson (``leaky``, ``fixed``); both needed."""
    curves, missing = {}, []
    for lesson in LEAK_LESSONS:
        path = Path(directory) / PRODUCTION_DIR / f"leak-{lesson}.json"
        report = json.loads(path.read_text()) if path.exists() else None
        if report is None or len(report.get("series", [])) < 2:
            missing.append(lesson)
        else:
            curves[lesson] = report
    if missing:
        commands = "; ".join(f"`{leak_command(directory, lesson)}`" for lesson in missing)
        raise MissingData(f"No memory curve for {', '.join(missing)} in {Path(directory) / PRODUCTION_DIR}. Run: {commands}.")
    return curves


DRAIN_OUTCOMES = {  # outcome -> (legend, colour)
    "answered": ("answered (200)", "tab:green"),
    "refused": ("refused: 503 + Retry-After", "tab:orange"),
    "no connection": ("no connection (the server is gone)", "tab:red"),
    "other": ("other error", "tab:gray"),
}


def _drain_outcome(status) -> str:
    if status == 200:
        return "answered"
    if status == 503:
        return "refused"
    return "no connection" if status == "no connection" else "other"


def plot_drain_timeline(timeline: Mapping):
    """Three panels on one time axis (seconds from the SIGTERM): requests in flight as ``/stats`` counted
    them, readiness as ``/readyz`` answered, and every client request as a bar from its start to its end,
    coloured by its outcome."""
    polls, spans = timeline.get("polls", []), timeline.get("requests", [])
    if not polls or not spans:
        raise MissingData(f"The drain timeline holds no polls or no requests. Run: `{drain_command(results_dir())}`.")
    flight_ax, ready_ax, requests_ax = Figure(figsize=(11, 8)).subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1, 3]})
    answered = [(p["t_s"], p["in_flight"]) for p in polls if p.get("in_flight") is not None]
    if answered:
        flight_ax.step(*zip(*answered, strict=True), where="post", color="tab:blue", label="in flight (/stats)")
    flight_ax.set_ylabel("requests in flight")
    flight_ax.set_ylim(bottom=0)
    flight_ax.set_title(f"Chapter 7's drain: {timeline.get('clients', '?')} closed-loop clients, SIGTERM at 0 s")

    ready = [(p["t_s"], 1 if p.get("ready") else 0) for p in polls if p.get("readyz_status") is not None]
    silent = [p["t_s"] for p in polls if p.get("readyz_status") is None]
    if ready:
        ready_ax.step(*zip(*ready, strict=True), where="post", color="tab:purple", label="/readyz")
    if silent:
        ready_ax.scatter(silent, [0] * len(silent), marker="|", color="tab:red", label="/readyz: no answer")
    ready_ax.set_yticks([0, 1], ["503 not ready", "200 ready"])
    ready_ax.set_ylim(-0.3, 1.3)
    ready_ax.set_ylabel("readiness")

    # One row per request in the order they started; bars for work, markers for instant refusals.
    ordered = sorted(spans, key=lambda r: r["start_s"])
    seen: set[str] = set()
    for row, span in enumerate(ordered):
        outcome = _drain_outcome(span["status"])
        label, colour = DRAIN_OUTCOMES[outcome]
        legend = None if outcome in seen else label
        seen.add(outcome)
        if outcome == "answered":
            requests_ax.plot([span["start_s"], span["end_s"]], [row, row], color=colour, linewidth=2, label=legend)
        else:
            requests_ax.scatter([span["end_s"]], [row], marker="x", s=14, color=colour, label=legend)
    requests_ax.set_ylabel("requests, in the order sent")
    requests_ax.set_xlabel("seconds from the SIGTERM")
    refused = sum(1 for s in spans if _drain_outcome(s["status"]) in ("refused", "no connection"))
    cut = sum(1 for s in spans if s["start_s"] < 0 and _drain_outcome(s["status"]) != "answered")
    requests_ax.set_title(f"{len(spans)} requests: {refused} refused after the signal; {cut} accepted before it "
                          f"and not answered")

    # The server's own account (its log, timed from the SIGTERM): when the drain ended, when uvicorn finished.
    for event in timeline.get("drain_log", []):
        if event["message"].startswith(("drained in", "drain timeout")) or event["message"].startswith("Finished server"):
            flight_ax.axvline(event["t_s"], color="gray", linestyle="-.", linewidth=1)
            flight_ax.annotate(event["message"].split(":")[0].split(" [")[0], (event["t_s"], 0), rotation=90,
                               xytext=(3, 4), textcoords="offset points", fontsize=7, va="bottom")
    exit_s = timeline.get("exit_s")
    for ax in (flight_ax, ready_ax, requests_ax):
        ax.axvline(0, color="black", linestyle="--", linewidth=1, label="SIGTERM" if ax is flight_ax else None)
        if exit_s is not None:
            ax.axvline(exit_s, color="tab:red", linestyle=":", linewidth=1.5,
                       label=f"process exit (+{exit_s:.2f} s)" if ax is flight_ax else None)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    flight_ax.figure.tight_layout()
    return flight_ax.figure


LEAK_FIGURES = {  # series key -> (panel title, judged?)
    "live_tensor_mb": ("live tensors the garbage collector reaches (MiB)", True),
    "python_heap_mb": ("Python heap, tracemalloc (MiB)", True),
    "rss_mb": ("process RSS (MiB): reported, not judged", False),
}


def plot_leak_curves(curves: Mapping[str, Mapping]):
    """Memory against requests sent after the warm-up, with the planted leak (``leaky``) and its fix
    (``fixed``): one panel per figure the leak check measures; the threshold drawn as a slope."""
    panels = [key for key in LEAK_FIGURES if any(p.get(key) is not None for c in curves.values() for p in c["series"])]
    axes = Figure(figsize=(5.2 * len(panels), 4.4)).subplots(1, len(panels), squeeze=False)[0]
    styles = {"leaky": ("tab:red", "o-"), "fixed": ("tab:green", "s-")}
    for ax, key in zip(axes, panels, strict=True):
        title, judged = LEAK_FIGURES[key]
        for lesson, report in curves.items():
            points = [(p["requests"], p[key]) for p in report["series"] if p.get(key) is not None]
            base = points[0][1]
            colour, style = styles.get(lesson, ("tab:gray", ".-"))
            growth = {"live_tensor_mb": "live_tensor_growth_mb_per_1000", "python_heap_mb": "python_heap_growth_mb_per_1000",
                      "rss_mb": "rss_growth_mb_per_1000"}[key]
            ax.plot([n for n, _ in points], [v - base for _, v in points], style, color=colour, markersize=4,
                    label=f"{lesson}: {report.get(growth, 0):+.1f} MiB / 1,000 requests")
        if judged:
            threshold = next(iter(curves.values())).get("threshold_mb", 8.0)
            last = max(p["requests"] for c in curves.values() for p in c["series"])
            ax.plot([0, last], [0, threshold * last / 1000], ":", color="gray",
                    label=f"threshold: {threshold:g} MiB / 1,000 requests")
        ax.set_xlabel("requests sent after the warm-up")
        ax.set_ylabel("growth since the warm-up (MiB)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    leaky = curves.get("leaky", {})
    axes[0].figure.suptitle(
        f"The leak check: {leaky.get('requests', '?')} requests, {leaky.get('failed', '?')} failed past their deadline "
        f"(leaky: flagged {'yes' if leaky.get('leaking') else 'no'}; fixed: flagged "
        f"{'yes' if curves.get('fixed', {}).get('leaking') else 'no'})")
    axes[0].figure.tight_layout()
    return axes[0].figure


# --------------------------------------------------------------------------------------------
# Chapter 8: streaming latencies and throughput, chapter 6 against chapter 8 at the same load
# --------------------------------------------------------------------------------------------

STREAMING_DIR = "streaming"
STREAMING_WORKLOADS = ("mixed", "default")


def streaming_command(directory: Path, workload: str) -> str:
    out = _relative(Path(directory) / STREAMING_DIR / f"{workload}.json")
    return (f"python -m benchmarks.streaming compare --chapters ch06 ch08 --workload {workload} --users 32 "
            f"--duration-s 30 --out {out}")


def load_streaming(directory: Path) -> dict[str, dict]:
    """``benchmarks.streaming compare`` results in ``directory/streaming/``, keyed by workload (mixed first)."""
    found = {}
    for workload in STREAMING_WORKLOADS:
        path = Path(directory) / STREAMING_DIR / f"{workload}.json"
        if path.exists():
            found[workload] = json.loads(path.read_text())
    if not found:
        commands = "; ".join(f"`{streaming_command(directory, w)}`" for w in STREAMING_WORKLOADS)
        raise MissingData(f"No streaming comparison in {Path(directory) / STREAMING_DIR}. Run: {commands}.")
    return found


STREAMING_LATENCIES = {  # key -> panel title
    "ttft_ms": "time to first token (TTFT)",
    "tpot_ms": "time per output token (TPOT)",
    "e2e_ms": "whole request (E2E)",
}


def plot_streaming_latencies(comparisons: Mapping[str, Mapping]):
    """One row per workload, one panel per latency (TTFT, TPOT, E2E): P50 and P99 per chapter, all at the
    same number of users. A chapter that does not stream has no TPOT, and its TTFT is its E2E."""
    axes = Figure(figsize=(15, 4.2 * len(comparisons))).subplots(len(comparisons), 3, squeeze=False)
    for row, (workload, comparison) in zip(axes, comparisons.items(), strict=True):
        chapters = list(comparison["chapters"])
        x = np.arange(len(chapters))
        for ax, (key, title) in zip(row, STREAMING_LATENCIES.items(), strict=True):
            drawn = False
            for offset, quantile, alpha in ((-0.2, "p50", 1.0), (0.2, "p99", 0.5)):
                values = [(comparison["chapters"][c].get(key) or {}).get(quantile) for c in chapters]
                if any(v is not None for v in values):
                    ax.bar(x + offset, [v or 0 for v in values], 0.4, alpha=alpha, color=[f"C{i}" for i in x])
                    drawn = True
            for i, chapter in enumerate(chapters):
                if key != "e2e_ms" and not comparison["chapters"][chapter].get("streamed"):
                    ax.annotate("does not stream" + (": TTFT = E2E" if key == "ttft_ms" else ""), (i, 0),
                                xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7, rotation=90
                                if key == "tpot_ms" else 0)
            if not drawn:
                ax.set_visible(False)
                continue
            ax.set_xticks(x, chapters)
            ax.set_ylabel("ms")
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(handles=[Patch(color="gray", label="P50 (left bar)"), Patch(color="gray", alpha=0.5, label="P99 (right bar)")],
                      fontsize=8)
    first = next(iter(comparisons.values()))
    axes[0][0].figure.suptitle(f"Chapter 6 (request-level batches) against chapter 8 (continuous batching), "
                               f"{first.get('users', '?')} closed-loop users")
    axes[0][0].figure.tight_layout()
    return axes[0][0].figure


def load_prefix_caching(directory: Path) -> dict[str, dict]:
    """Chapter 8's prefix-caching comparisons (``directory/ch08/prefix-caching/<workload>.json``), keyed by
    workload, ``shared-prefix`` first."""
    from benchmarks.streaming import PREFIX_CACHING_DIR, PREFIX_CACHING_WORKLOADS, prefix_caching_command

    folder = Path(directory) / PREFIX_CACHING_DIR
    found = {w: json.loads((folder / f"{w}.json").read_text()) for w in PREFIX_CACHING_WORKLOADS if (folder / f"{w}.json").exists()}
    if not found:
        commands = "; ".join(f"`{prefix_caching_command(w, _relative(Path(directory)))}`" for w in PREFIX_CACHING_WORKLOADS)
        raise MissingData(f"No prefix-caching comparison in {folder}. Run: {commands}.")
    return found


def plot_prefix_caching(comparisons: Mapping[str, Mapping]):
    """Chapter 8 with prefix caching on and off, per workload: TTFT (P50 and P99) and completed requests/s,
    at the same number of streaming users."""
    from benchmarks.streaming import PREFIX_CACHING_VARIANTS

    ttft_ax, qps_ax = Figure(figsize=(12, 4.4)).subplots(1, 2)
    workloads = list(comparisons)
    x = np.arange(len(workloads))
    for i, label in enumerate(PREFIX_CACHING_VARIANTS):
        figures = [comparisons[w]["chapters"].get(label) or {} for w in workloads]
        offset = (i - 0.5) * 0.4
        for quantile, alpha in (("p99", 0.4), ("p50", 1.0)):  # P50 drawn over P99 in the same bar
            values = [(f.get("ttft_ms") or {}).get(quantile) or 0 for f in figures]
            ttft_ax.bar(x + offset, values, 0.4, color=f"C{i}", alpha=alpha,
                        label=f"{label}, {quantile.upper()}")
        qps_ax.bar(x + offset, [f.get("qps") or 0 for f in figures], 0.4, color=f"C{i}", label=label)
    labels = [f"{w}\n({comparisons[w].get('users', '?')} users)" for w in workloads]
    for ax, ylabel, title in ((ttft_ax, "ms", "Time to first token, prefix caching on and off"),
                              (qps_ax, "completed requests/s", "QPS, prefix caching on and off")):
        ax.set_xticks(x, labels)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ttft_ax.figure.tight_layout()
    return ttft_ax.figure


def plot_streaming_throughput(comparisons: Mapping[str, Mapping]):
    """Completed requests/s and generated tokens/s per chapter and workload, at equal load (same users)."""
    qps_ax, tokens_ax = Figure(figsize=(12, 4.4)).subplots(1, 2)
    workloads = list(comparisons)
    chapters = sorted({c for comparison in comparisons.values() for c in comparison["chapters"]})
    width = 0.8 / len(chapters)
    x = np.arange(len(workloads))
    for i, chapter in enumerate(chapters):
        for ax, key in ((qps_ax, "qps"), (tokens_ax, "output_tokens_per_s")):
            values = [comparisons[w]["chapters"].get(chapter, {}).get(key) or 0 for w in workloads]
            ax.bar(x + (i - (len(chapters) - 1) / 2) * width, values, width, color=f"C{i}", label=chapter)
    labels = [f"{w}\n({comparisons[w].get('users', '?')} users, {comparisons[w].get('duration_s', '?')} s)" for w in workloads]
    for ax, ylabel, title in ((qps_ax, "completed requests/s", "QPS at equal load"),
                              (tokens_ax, "generated tokens/s", "Tokens/s at equal load")):
        ax.set_xticks(x, labels)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    qps_ax.figure.tight_layout()
    return qps_ax.figure


# --------------------------------------------------------------------------------------------
# Chapter 8: where a step's time goes, per load level (the step records /stats keeps)
# --------------------------------------------------------------------------------------------

STEP_PHASES = ("schedule", "prepare", "model", "update")


STEP_CLIMB_DIR = Path("ch08") / "climb"  # the whole climb measured after the packed step, beside the reference's


def load_step_records(directory: Path, chapter: str = "ch08") -> dict[int, list[dict]]:
    """``{users: [step record, ...]}`` from ``directory/<chapter>.json`` (else ``directory/ch08/climb/``):
    the last steps chapter 8's engine kept at the end of each level (``server_series.steps``)."""
    result = load_results(Path(directory)).get(chapter)
    if not (result and any(level.server_series and level.server_series.steps for level in result.levels)):
        climb = Path(directory) / STEP_CLIMB_DIR
        result = load_results(climb).get(chapter) if climb.exists() else result
    found = {level.users: level.server_series.steps for level in (result.levels if result else [])
             if level.server_series is not None and level.server_series.steps}
    if not found:
        raise MissingData(f"No step records for {chapter} in {directory}: the harness keeps them since the packed step "
                          f"(`python -m benchmarks run --chapter {chapter} --profile cpu --out {_relative(Path(directory))}`).")
    return dict(sorted(found.items()))


def plot_step_split(records: Mapping[int, list[dict]]):
    """Left: the median step's milliseconds per phase at each load (stacked). Right: the steps of the
    highest load, one bar each: decode rows and prompt-chunk tokens computed."""
    split_ax, steps_ax = Figure(figsize=(13, 4.4)).subplots(1, 2)
    levels = list(records)
    bottom = np.zeros(len(levels))
    for i, phase in enumerate(STEP_PHASES):
        values = np.array([float(np.median([r[f"{phase}_ms"] for r in records[u]])) for u in levels])
        split_ax.bar([str(u) for u in levels], values, bottom=bottom, color=f"C{i}", label=phase)
        bottom += values
    for x, (users, total) in enumerate(zip(levels, bottom, strict=True)):
        model = float(np.median([r["model_ms"] for r in records[users]]))
        split_ax.annotate(f"{total:.1f} ms\n(model {model / total:.0%})", (x, total), ha="center", va="bottom", fontsize=8)
    split_ax.set_xlabel("closed-loop users")
    split_ax.set_ylabel("median step, per phase (ms)")
    split_ax.set_title("Where a step's time goes")
    split_ax.legend(fontsize=8)
    split_ax.grid(True, axis="y", alpha=0.3)
    top = records[levels[-1]]
    index = np.arange(len(top))
    decodes = np.array([r["decode_rows"] for r in top])
    prefill = np.array([r["prefill_tokens"] for r in top])
    steps_ax.bar(index, decodes, width=1.0, color="C0", label="decode rows (one token each)")
    steps_ax.bar(index, prefill, width=1.0, bottom=decodes, color="C1", label="prompt-chunk tokens")
    steps_ax.set_xlabel(f"the last {len(top)} steps at {levels[-1]} users")
    steps_ax.set_ylabel("tokens computed in the step")
    steps_ax.set_title("What each step computed (one packed forward each)")
    steps_ax.legend(fontsize=8)
    steps_ax.grid(True, axis="y", alpha=0.3)
    split_ax.figure.tight_layout()
    return split_ax.figure


# --------------------------------------------------------------------------------------------
# Chapter 9: the failure drill, autoscaling under a step load, one replica against two
# --------------------------------------------------------------------------------------------

SCALE_OUT_DIR = "ch09"
DRILL_OUTCOMES = {  # outcome -> (legend, colour)
    "ok": ("answered", "tab:green"),
    "replayed": ("replayed by the edge, then answered", "tab:blue"),
    "contract_error": ("the contract's error (JSON 500 / event: error)", "tab:orange"),
    "broken": ("broken: plain text, cut stream, dropped", "tab:red"),
}


def load_scale_out(directory: Path, name: str) -> dict:
    """One of chapter 9's recordings in ``directory/ch09/`` (``failure-drill.json``, ``autoscale-timeline.json``, ...)."""
    path = Path(directory) / SCALE_OUT_DIR / name
    if not path.exists():
        scenario = "drill" if name.startswith("failure-drill") else "autoscale"
        if name.startswith("replicas"):
            command = f"python -m benchmarks.scale_out_compare --out {_relative(path)}"
        elif name.startswith("simulation"):
            command = f"python -m chapters.ch09_scale_out.simulation run --out {_relative(path)}"
        else:
            command = f"python -m benchmarks.scale_out_timeline {scenario} --out {_relative(path)}"
        raise MissingData(f"No {name} in {Path(directory) / SCALE_OUT_DIR}. Run: `{command}`.")
    return json.loads(path.read_text())


def _capacity_panels(timeline: Mapping, title: str, zero_label: str):
    """Three panels on one time axis: replicas running (and clients), answers/s and P99 per second, every request."""
    from benchmarks.scale_out_timeline import per_window

    polls, spans = timeline.get("polls", []), timeline.get("requests", [])
    if not polls or not spans:
        raise MissingData("This timeline holds no polls or no requests.")
    replicas_ax, rate_ax, requests_ax = Figure(figsize=(11, 9)).subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [1.3, 2, 3]})
    counted = [(p["t_s"], p["running"]) for p in polls if p["running"] is not None]
    replicas_ax.step(*zip(*counted, strict=True), where="post", color="tab:purple", label="replicas running (Serve)")
    alive = [(p["t_s"], len(p["replica_pids"])) for p in polls]
    replicas_ax.step(*zip(*alive, strict=True), where="post", color="tab:gray", linestyle=":", label="replica processes alive")
    replicas_ax.set_ylabel("replicas")
    replicas_ax.set_ylim(0, max(n for _, n in alive + counted) + 1)
    replicas_ax.set_title(title)

    windows = per_window(spans)
    rate_ax.plot([w["t_s"] for w in windows], [w["qps"] for w in windows], color="tab:green", label="answers/s")
    rate_ax.set_ylabel("answers per second")
    p99_ax = rate_ax.twinx()
    p99_ax.plot([w["t_s"] for w in windows if w["p99_ms"] is not None], [w["p99_ms"] for w in windows if w["p99_ms"] is not None],
                color="tab:red", marker=".", linewidth=1, label="P99 of the answers of that second (ms)")
    p99_ax.set_ylabel("P99 (ms)")
    p99_ax.legend(fontsize=8, loc="upper right")

    ordered = sorted(spans, key=lambda r: r["start_s"])
    seen: set[str] = set()
    for row, span in enumerate(ordered):
        label, colour = DRILL_OUTCOMES[span["outcome"]]
        legend = None if span["outcome"] in seen else label
        seen.add(span["outcome"])
        requests_ax.plot([span["start_s"], span["end_s"]], [row, row], color=colour, linewidth=1.5 if span["outcome"] == "ok" else 3,
                         label=legend)
    requests_ax.set_ylabel("requests, in the order sent")
    requests_ax.set_xlabel(zero_label)
    for ax in (replicas_ax, rate_ax, requests_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return replicas_ax, rate_ax, requests_ax


def plot_failure_drill(timeline: Mapping):
    """The drill: one replica's process killed at 0 s under load; capacity, latency and every request around it."""
    ledger = timeline["accounting"]
    replicas_ax, rate_ax, requests_ax = _capacity_panels(
        timeline, f"Failure drill: one of {timeline['server_args'][1]} replicas killed at 0 s, "
                  f"{timeline['steps'][0][1]} closed-loop clients", "seconds from the SIGKILL")
    back = ledger.get("capacity_back_s")
    for ax in (replicas_ax, rate_ax, requests_ax):
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        if back is not None:
            ax.axvline(back, color="tab:purple", linestyle="-.", linewidth=1)
    if back is not None:
        replicas_ax.annotate(f"back to {timeline['server_args'][1]} running: +{back:.1f} s", (back, 0.2), xytext=(4, 0),
                             textcoords="offset points", fontsize=8)
    requests_ax.set_title(f"{ledger['requests']} requests: {ledger['replayed']} replayed, {ledger['contract_error']} the contract's "
                          f"error, {ledger['broken']} broken; {ledger['touched_outside_kill']} touched outside the kill")
    replicas_ax.figure.tight_layout()
    return replicas_ax.figure


def plot_autoscale_timeline(timeline: Mapping):
    """Autoscaling under a step load: clients and replicas, capacity and P99 over time."""
    replicas_ax, rate_ax, requests_ax = _capacity_panels(
        timeline, "Autoscaling on requests held per replica, under a step load", "seconds from the start of the load")
    clients_ax = replicas_ax.twinx()
    edges, start = [], 0.0
    for seconds, clients in timeline["steps"]:
        edges.append((start, clients))
        start += seconds
    edges.append((start, timeline["steps"][-1][1]))
    clients_ax.step(*zip(*edges, strict=True), where="post", color="tab:cyan", label="closed-loop clients")
    clients_ax.set_ylabel("clients")
    clients_ax.legend(fontsize=8, loc="upper right")
    replicas_ax.figure.tight_layout()
    return replicas_ax.figure


def plot_replicas_and_routers(comparison: Mapping):
    """Chapter 8 alone, one replica behind Serve, two under each router: answers/s and latency, medians of the rounds."""
    labels = list(comparison["configs"])
    medians = [comparison["configs"][label]["median"] for label in labels]
    qps_ax, latency_ax = Figure(figsize=(12, 4.6)).subplots(1, 2)
    x = np.arange(len(labels))
    qps_ax.bar(x, [m["qps"] for m in medians], color=[f"C{i}" for i in range(len(labels))])
    qps_ax.set_ylabel("answers per second")
    qps_ax.set_title(f"Throughput, {comparison['users']} streaming users, `{comparison['workload']}`")
    width = 0.38
    latency_ax.bar(x - width / 2, [m["e2e_ms_p50"] for m in medians], width, label="E2E P50")
    latency_ax.bar(x + width / 2, [m["e2e_ms_p99"] for m in medians], width, label="E2E P99")
    latency_ax.set_ylabel("ms")
    latency_ax.set_title("Whole-answer latency")
    latency_ax.legend(fontsize=8)
    for ax in (qps_ax, latency_ax):
        ax.set_xticks(x, [label.replace(", ", ",\n") for label in labels], fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    qps_ax.figure.tight_layout()
    return qps_ax.figure


def plot_simulated_scaling(results: Mapping, mix: str = "mixed"):
    """The simulation of 1 to 64 replicas: P99 and goodput per replica against replicas, per router, at 85 % and
    95 % of capacity (``chapters.ch09_scale_out.plots.plot_scaling``)."""
    from chapters.ch09_scale_out.plots import plot_scaling

    axes = Figure(figsize=(12, 9)).subplots(2, 2)
    for row, utilisation in enumerate((0.85, 0.95)):
        plot_scaling(results, axes[row][0], axes[row][1], mix=mix, utilisation=utilisation)
    axes[0][0].figure.tight_layout()
    return axes[0][0].figure

