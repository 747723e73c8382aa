"""Chapters 4 to 6: the pool, accuracy against throughput, the tuner's sweep and the adaptive window.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from itertools import product
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from benchmarks.harness.results import BenchmarkResult, REFERENCE_ROOT
from benchmarks.report.notebook_plots.common import (
    CLOSED_COMMAND,
    LONG_COMMAND,
    MissingData,
    levels_of,
    require_present,
    require_results,
    users_axis,
)


# --------------------------------------------------------------------------------------------
# Chapter 4: the pool
# --------------------------------------------------------------------------------------------


def plot_step_time(long_results: Mapping[str, BenchmarkResult], labels: Sequence[str] = ("ch03", "ch04")):
    """Decode time per generated token against the prompt's length (``long`` workload, at the lowest load
    measured: one request at a time where 1 user was measured), ``torch.cat`` cache (chapter 3) against
    the pre-allocated pool (chapter 4)."""
    runs = require_results(long_results, labels, LONG_COMMAND)
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
    runs = require_results(long_results, labels, LONG_COMMAND)
    tokens_ax, p99_ax = Figure(figsize=(12, 4.5)).subplots(1, 2)
    for n, result in enumerate(runs):
        levels = levels_of(result)
        users = [lvl.users for lvl in levels]
        tokens_ax.plot(users, [lvl.tokens_per_s for lvl in levels], "o-", color=f"C{n}", label=result.label)
        p99_ax.plot(users, [lvl.latency_ms.p99 for lvl in levels], "o-", color=f"C{n}", label=result.label)
    users = sorted({lvl.users for r in runs for lvl in r.levels})
    for ax in (tokens_ax, p99_ax):
        users_axis(ax, users)
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
    runs = require_results(long_results, (before, after), LONG_COMMAND)
    if len(runs) < 2:
        raise MissingData(f"Both {before} and {after} are needed on the long workload. Run: `{LONG_COMMAND}`.")
    first, second = ({lvl.users: lvl for lvl in levels_of(r)} for r in runs)
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
    require_present(result, "the pool over time")
    levels = [lvl for lvl in result.levels if lvl.server_series and lvl.server_series.points]
    names = [name for name in POOL_SERIES
             if any(_series_value(p, lvl.server_series.constants, name) is not None
                    for lvl in levels for p in lvl.server_series.points)]
    if not levels or not names:
        raise MissingData(
            f"`{result.label}`'s results hold no pool figures over time (the harness's polls of `/stats`). "
            f"Run: `python -m benchmarks run --chapter {result.chapter} --profile {result.profile}`."
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
    runs = require_results(results, labels, CLOSED_COMMAND)
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
    """Chapter 5's trade-off table (``python -m benchmarks.harness.tradeoffs --save-reference``)."""
    path = Path(path or os.environ.get("SFS_TRADEOFFS_FILE") or REFERENCE_ROOT / "ch05-tradeoffs" / "latest.json")
    if not path.exists():
        raise MissingData(f"No trade-off table at {path}. Run: "
                          f"`python -m benchmarks.harness.tradeoffs --save-reference`.")
    return json.loads(path.read_text())


def plot_tradeoffs(table: Mapping):
    """Every available engine x precision: held-out accuracy against batch throughput (left) and
    against the one-request latency (right)."""
    rows = [row for row in table.get("rows", []) if row.get("available") and row.get("throughput_tok_s")]
    if not rows:
        raise MissingData("The trade-off table has no measured rows. Run: "
                          "`python -m benchmarks.harness.tradeoffs --save-reference`.")
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
    runs = require_results(results, labels, CLOSED_COMMAND)
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
