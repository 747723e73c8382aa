"""Chapters 1 to 3: the queue nobody shows, sync against async and where one request's time goes,
batch sizes, padding and the window's trade-off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from benchmarks.harness.article import ARTICLE
from benchmarks.harness.results import BenchmarkResult, OpenLoopResult
from benchmarks.report.notebook_plots.common import (
    CLOSED_COMMAND,
    MissingData,
    article_line,
    levels_of,
    levels_with_stages,
    require_present,
    require_results,
    speedups_over_baseline,
    users_axis,
)


# --------------------------------------------------------------------------------------------
# Chapter 1: the queue nobody shows
# --------------------------------------------------------------------------------------------


def plot_queue_nobody_shows(results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch01", "ch01-workers")):
    """P50 against concurrency beside ``users x`` the one-user P50: a server that serves one request at
    a time makes the n-th client wait for the n-1 before it, and none of that wait is on the server's clock."""
    runs = require_results(results, labels, CLOSED_COMMAND)
    ax = Figure(figsize=(7, 4.5)).subplots()
    for n, result in enumerate(runs):
        levels = levels_of(result)
        users = [lvl.users for lvl in levels]
        ax.plot(users, [lvl.latency_ms.p50 for lvl in levels], "o-", color=f"C{n}", label=f"{result.label}: P50 measured")
        alone = levels[0].latency_ms.p50 / levels[0].users
        ax.plot(users, [u * alone for u in users], ":", color=f"C{n}",
                label=f"{result.label}: users × P50 alone (a pure queue)")
    users_axis(ax, sorted({lvl.users for r in runs for lvl in r.levels}))
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
    levels = [lvl for lvl in levels_with_stages(result, "client against server time") if lvl.samples]
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
    runs = require_results(results, labels, CLOSED_COMMAND)
    latency_ax, qps_ax, ratio_ax = Figure(figsize=(16, 4.5)).subplots(1, 3)
    for n, result in enumerate(runs):
        levels = levels_of(result)
        users = [lvl.users for lvl in levels]
        color = f"C{n}"
        latency_ax.plot(users, [lvl.latency_ms.p50 for lvl in levels], "o-", color=color, label=f"{result.label} P50")
        latency_ax.plot(users, [lvl.latency_ms.p99 for lvl in levels], "s--", color=color, label=f"{result.label} P99")
        qps_ax.plot(users, [lvl.qps for lvl in levels], "o-", color=color, label=result.label)
    all_users = sorted({lvl.users for r in runs for lvl in r.levels})
    for ax in (latency_ax, qps_ax):
        users_axis(ax, all_users)
        ax.legend(fontsize=8)
    latency_ax.set_yscale("log")
    latency_ax.set_ylabel("latency (ms)")
    latency_ax.set_title("Latency against load")
    qps_ax.set_ylabel("QPS (successful requests/s)")
    qps_ax.set_ylim(bottom=0)
    qps_ax.set_title("Throughput against load")
    chapters = [c for c in labels if c in ARTICLE]
    article_line(ratio_ax, chapters, speedups_over_baseline(results, chapters))
    latency_ax.figure.suptitle(title)
    latency_ax.figure.tight_layout()
    return latency_ax.figure


def plot_stage_breakdown(result: BenchmarkResult | OpenLoopResult):
    """Stacked P50 of each server stage per level (``total`` and stages that contain others left out),
    beside the client's P50: where one request's time goes as the load grows."""
    levels = levels_with_stages(result, "where the time goes")
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
    require_present(result, "batch sizes")
    levels = [lvl for lvl in result.levels if lvl.server_series and lvl.server_series.batch_sizes]
    if not levels:
        raise MissingData(
            f"`{result.label}`'s results hold no batch sizes (the harness's polls of `/stats`). "
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
    runs = require_results(results, (before, after), CLOSED_COMMAND)
    if len(runs) < 2:
        raise MissingData(f"Both {before} and {after} are needed. Run: `{CLOSED_COMMAND}`.")
    first, second = (min(levels_of(r), key=lambda lvl: lvl.users) for r in runs)
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
    runs = require_results(results, (before, after), CLOSED_COMMAND)
    latency_ax, qps_ax = Figure(figsize=(12, 4.5)).subplots(1, 2)
    for n, result in enumerate(runs):
        levels = levels_of(result)
        users = [lvl.users for lvl in levels]
        latency_ax.plot(users, [lvl.latency_ms.p50 for lvl in levels], "o-", color=f"C{n}", label=f"{result.label} P50")
        queued = [(lvl.users, lvl.stages_ms["queue"].p50) for lvl in levels if lvl.stages_ms and "queue" in lvl.stages_ms]
        if queued:
            latency_ax.plot(*zip(*queued, strict=True), "^:", color=f"C{n}", label=f"{result.label}: queue stage P50")
        qps_ax.plot(users, [lvl.qps for lvl in levels], "o-", color=f"C{n}", label=result.label)
    users = sorted({lvl.users for r in runs for lvl in r.levels})
    for ax in (latency_ax, qps_ax):
        users_axis(ax, users)
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
