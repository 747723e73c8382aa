"""Chapter 8: streaming latencies and throughput, chapter 6 against chapter 8 at the same load, prefix
caching, and where a step's time goes per load level.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from benchmarks.harness.results import load_results
from benchmarks.report.notebook_plots.common import MissingData, repo_relative


# --------------------------------------------------------------------------------------------
# Chapter 8: streaming latencies and throughput, chapter 6 against chapter 8 at the same load
# --------------------------------------------------------------------------------------------

STREAMING_DIR = "streaming"
STREAMING_WORKLOADS = ("mixed", "default")


def streaming_command(directory: Path, workload: str) -> str:
    out = repo_relative(Path(directory) / STREAMING_DIR / f"{workload}.json")
    return (f"python -m benchmarks.harness.streaming compare --chapters ch06 ch08 --workload {workload} --users 32 "
            f"--duration-s 30 --out {out}")


def load_streaming(directory: Path) -> dict[str, dict]:
    """``benchmarks.harness.streaming compare`` results in ``directory/streaming/``, keyed by workload (mixed first)."""
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
    from benchmarks.harness.streaming import PREFIX_CACHING_DIR, PREFIX_CACHING_WORKLOADS, prefix_caching_command

    folder = Path(directory) / PREFIX_CACHING_DIR
    found = {w: json.loads((folder / f"{w}.json").read_text()) for w in PREFIX_CACHING_WORKLOADS if (folder / f"{w}.json").exists()}
    if not found:
        commands = "; ".join(f"`{prefix_caching_command(w, repo_relative(Path(directory)))}`" for w in PREFIX_CACHING_WORKLOADS)
        raise MissingData(f"No prefix-caching comparison in {folder}. Run: {commands}.")
    return found


def plot_prefix_caching(comparisons: Mapping[str, Mapping]):
    """Chapter 8 with prefix caching on and off, per workload: TTFT (P50 and P99) and completed requests/s,
    at the same number of streaming users."""
    from benchmarks.harness.streaming import PREFIX_CACHING_VARIANTS

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
        raise MissingData(f"No step records for {chapter} in {directory} "
                          f"(`python -m benchmarks run --chapter {chapter} --profile cpu --out {repo_relative(Path(directory))}`).")
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
