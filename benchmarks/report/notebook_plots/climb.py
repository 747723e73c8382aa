"""The climb notebook: CPU beside GPU beside the article, and the knees.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure

from benchmarks.harness.article import ARTICLE, BASELINE
from benchmarks.harness.results import BenchmarkResult, OpenLoopResult
from benchmarks.report.knees import describe_open_knee, open_knee_of
from benchmarks.report.notebook_plots.ch01_to_ch03 import plot_latency_and_qps, plot_queue_nobody_shows
from benchmarks.report.notebook_plots.common import CLOSED_COMMAND, MissingData, OPEN_COMMAND, load_real_model, speedups_over_baseline


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
        ("CPU reference", speedups_over_baseline(cpu, chapters), {"color": "tab:blue"}),
        ("GPU reference", speedups_over_baseline(gpu, chapters), {"color": "tab:orange"}),
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
# The real model (SmolLM2-135M-Instruct): the climb, and each chapter's step on it
# --------------------------------------------------------------------------------------------


def real_model_table() -> str:
    """The real model's climb as the climb's own table (markdown)."""
    from benchmarks.report import missing_chapter_notes, render_table

    real = load_real_model()
    chapters = sorted({r.chapter for r in real.values()})
    return render_table(real, chapters, missing_chapter_notes(chapters))


def plot_real_model_climb():
    """The real model's climb: QPS and P99 per chapter beside the article's speed-ups."""
    from benchmarks.report import build_rows, plot_climb

    real = load_real_model()
    return plot_climb(build_rows(real, sorted({r.chapter for r in real.values()})), title="The climb on SmolLM2-135M")


def plot_real_model_step(labels: tuple[str, ...]):
    """A chapter's step on the real model: chapter 1's queue alone, or a chapter against the one before it."""
    real = load_real_model()
    if labels == ("ch01",):
        return plot_queue_nobody_shows(real, labels)
    return plot_latency_and_qps(real, labels, title=f"{' against '.join(reversed(labels))}, on SmolLM2-135M")
