"""The climb's figures: QPS and P99 per chapter beside the article's, latency against load, the open loop.

Plots are :class:`matplotlib.figure.Figure` objects, not pyplot: ``savefig`` renders them with the
Agg backend whatever backend is active (none on servers and CI), and nothing global is left open.
A notebook shows them with ``display(figure)``. The climb plot draws the P99 at the top load (see
:mod:`benchmarks.report.tables`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure

from benchmarks.harness.results import BenchmarkResult, OpenLoopResult
from benchmarks.report.knees import knee_of, open_knee_of
from benchmarks.report.tables import TableRow


def plot_climb(rows: Sequence[TableRow], axes=None, title: str = "The climb", variants: Sequence[TableRow] = ()):
    """Left: QPS per chapter as bars (measured, article) and P99 as lines on a second axis. Right: the
    speed-up over ch01, measured beside the article's, where the shapes compare across machines.
    ``variants`` (labelled runs of a chapter, such as a learner's own ``--label ch03-mine``) get a
    narrow bar of their own inside their chapter's, labelled with their name.
    ``axes``: two matplotlib axes, or None for a new figure. Returns the figure."""
    if axes is None:
        axes = Figure(figsize=(14, 5)).subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    ax, ratio_ax = axes
    figure = ax.figure
    x = list(range(len(rows)))
    width = 0.38
    left, right = [i - width / 2 for i in x], [i + width / 2 for i in x]
    ax.bar(left, [row.qps or 0 for row in rows], width, label="QPS, measured", color="tab:blue")
    ax.bar(right, [row.article_qps or 0 for row in rows], width, label="QPS, article", color="tab:blue", alpha=0.3,
           hatch="//")
    for i, row in enumerate(rows):
        if not row.measured:
            ax.annotate(row.note, (left[i], 0), rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
    position = {row.chapter: i for i, row in enumerate(rows)}
    placed = [(variant, position[variant.chapter]) for variant in variants if variant.qps and variant.chapter in position]
    for n, (variant, i) in enumerate(placed):
        bar = ax.bar(left[i], variant.qps, width / 3, color="tab:orange", edgecolor="black",
                     label="QPS, a labelled run (its name on the bar)" if n == 0 else None)
        ax.bar_label(bar, [variant.label], rotation=90, fontsize=7, padding=2)
    ax.set_xticks(x, [row.label for row in rows])
    ax.set_ylabel("QPS at saturation")
    ax.set_title(title)

    latency_ax = ax.twinx()
    measured = [(i, row.p99_top_ms / 1e3) for i, row in enumerate(rows) if row.p99_top_ms is not None]
    article = [(i, row.article_p99_ms / 1e3) for i, row in enumerate(rows) if row.article_p99_ms is not None]
    if measured:
        latency_ax.plot(*zip(*measured, strict=True), "o-", color="tab:red", label="P99 at the top load, measured")
    if article:
        latency_ax.plot(*zip(*article, strict=True), "s--", color="tab:red", alpha=0.4, label="P99, article")
    latency_ax.set_ylabel("P99 latency (s)")
    latency_ax.set_ylim(bottom=0)
    (bar_handles, bar_labels), (line_handles, line_labels) = (
        ax.get_legend_handles_labels(), latency_ax.get_legend_handles_labels()
    )
    ax.legend(bar_handles + line_handles, bar_labels + line_labels, loc="upper left", fontsize=8)

    ratio_ax.bar(left, [row.ratio_to_baseline or 0 for row in rows], width, label="measured", color="tab:green")
    ratio_ax.bar(right, [row.article_ratio or 0 for row in rows], width, label="article", color="tab:green", alpha=0.3,
                 hatch="//")
    ratio_ax.axhline(1.0, color="gray", linewidth=0.8)
    ratio_ax.set_xticks(x, [row.label for row in rows])
    ratio_ax.set_ylabel("QPS / QPS of ch01")
    ratio_ax.set_title("Speed-up over ch01: the shape to compare")
    ratio_ax.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    return figure


def plot_latency_vs_load(results: Mapping[str, BenchmarkResult], axes=None, title: str = "Latency against load"):
    """P50 and P99 against concurrency for every run, saturation circled; variants dashed. Returns the figure."""
    if axes is None:
        axes = Figure(figsize=(11, 4.5)).subplots(1, 2, sharey=True)
    figure = axes[0].figure
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, label in enumerate(sorted(results)):
        result = results[label]
        levels = sorted((lvl for lvl in result.levels if lvl.latency_ms is not None), key=lambda lvl: lvl.users)
        if not levels:
            continue
        users = [lvl.users for lvl in levels]
        style = "-" if result.label == result.chapter else "--"
        color = colors[n % len(colors)]
        knee = knee_of(result)
        for ax, metric in zip(axes, ("p50", "p99"), strict=True):
            values = [getattr(lvl.latency_ms, metric) for lvl in levels]
            ax.plot(users, values, style, marker="o", markersize=4, color=color, label=label)
            if knee is not None and knee.reached:
                ax.plot(users[knee.index], values[knee.index], "o", markersize=13, markerfacecolor="none",
                        markeredgecolor=color, markeredgewidth=2)
    all_users = sorted({lvl.users for r in results.values() for lvl in r.levels})
    for ax, metric in zip(axes, ("P50", "P99"), strict=True):
        ax.set_xscale("log", base=2)
        if all_users:
            ax.set_xticks(all_users, [str(u) for u in all_users])
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (closed-loop users)")
        ax.set_title(f"{metric} latency (ms); circle = saturation (90 % of the best QPS)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("latency (ms)")
    if results:
        axes[-1].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def plot_open_loop(open_results: Mapping[str, OpenLoopResult], axes=None, title: str = "Open loop: offered rate swept upward"):
    """Three panels against the offered rate: the achieved rate (the diagonal = keeping up), P99 (log;
    the circle marks the knee, the cross the first rate past it) and goodput within the SLO. Returns the figure."""
    if axes is None:
        axes = Figure(figsize=(15, 4.5)).subplots(1, 3)
    achieved_ax, p99_ax, goodput_ax = axes
    figure = achieved_ax.figure
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    top = max((lvl.offered_rps for r in open_results.values() for lvl in r.levels), default=1.0)
    achieved_ax.plot([0, top], [0, top], ":", color="gray", label="achieved = offered")
    slo = None
    for n, label in enumerate(sorted(open_results)):
        result = open_results[label]
        levels = sorted(result.levels, key=lambda lvl: lvl.offered_rps)
        if not levels:
            continue
        slo = result.config.slo_ms
        color = colors[n % len(colors)]
        style = "-" if result.label == result.chapter else "--"
        offered = [lvl.offered_rps for lvl in levels]
        achieved_ax.plot(offered, [lvl.qps for lvl in levels], style, marker="o", markersize=4, color=color, label=label)
        goodput_ax.plot(offered, [lvl.goodput_rps for lvl in levels], style, marker="o", markersize=4, color=color,
                        label=label)
        with_latency = [lvl for lvl in levels if lvl.latency_ms is not None]
        p99_ax.plot([lvl.offered_rps for lvl in with_latency], [lvl.latency_ms.p99 for lvl in with_latency], style,
                    marker="o", markersize=4, color=color, label=label)
        knee = open_knee_of(result)
        if knee is not None and knee.reached and knee.index >= 0 and levels[knee.index].latency_ms is not None:
            p99_ax.plot(offered[knee.index], levels[knee.index].latency_ms.p99, "o", markersize=13,
                        markerfacecolor="none", markeredgecolor=color, markeredgewidth=2)
        if knee is not None and knee.broke_at is not None:
            broke = levels[knee.index + 1]
            if broke.latency_ms is not None:
                p99_ax.plot(broke.offered_rps, broke.latency_ms.p99, "x", markersize=10, color=color)
    achieved_ax.set_title("Achieved rate (below the diagonal: falling behind)")
    achieved_ax.set_ylabel("achieved (successful requests/s)")
    p99_ax.set_title("P99 latency (ms); circle = knee, cross = first rate past it")
    p99_ax.set_ylabel("P99 latency (ms)")
    p99_ax.set_yscale("log")
    goodput_ax.set_title(f"Goodput: answered within the SLO ({'—' if slo is None else f'{slo:,.0f} ms'})")
    goodput_ax.set_ylabel("goodput (requests/s)")
    for ax in axes:
        ax.set_xlabel("offered rate (requests/s, Poisson arrivals)")
        ax.grid(True, which="both", alpha=0.3)
        if open_results:
            ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure
