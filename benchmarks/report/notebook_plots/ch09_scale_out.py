"""Chapter 9: the failure drill, autoscaling under a step load, replicas and routers, Serve's path, the simulation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from benchmarks.report.notebook_plots.common import MissingData, repo_relative
from benchmarks.report.scale_out_blocks import answer_costs, serve_path_command


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
            command = f"python -m benchmarks.studies.replicas_and_routers.scale_out_compare --out {repo_relative(path)}"
        elif name.startswith("serve-path-"):
            command = serve_path_command(name.removeprefix("serve-path-").removesuffix(".json"), repo_relative(path))
        elif name.startswith("simulation"):
            command = f"python -m benchmarks.studies.scale_out_simulation.sweep --out {repo_relative(path)}"
        else:
            command = f"python -m benchmarks.studies.scale_out_timeline.scale_out_timeline {scenario} --out {repo_relative(path)}"
        raise MissingData(f"No {name} in {Path(directory) / SCALE_OUT_DIR}. Run: `{command}`.")
    return json.loads(path.read_text())


def _capacity_panels(timeline: Mapping, title: str, zero_label: str):
    """Three panels on one time axis: replicas running (and clients), answers/s and P99 per second, every request."""
    from benchmarks.report.scale_out_timelines import per_window

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


def plot_serve_path_costs(comparisons: Mapping[str, Mapping]):
    """Serve's path, one panel per workload: core-milliseconds per answer by process (stacked), each configuration's
    median cores busy over its median answers per second (``scale_out_blocks.answer_costs``)."""
    axes = Figure(figsize=(12, 4.6)).subplots(1, len(comparisons), squeeze=False)[0]
    parts = {"app": ("the app's process (chapter 8 alone, or the replica)", "tab:blue"), "proxy": ("Serve's proxy", "tab:orange"),
             "others": ("Serve's and Ray's others", "tab:gray")}
    for ax, (workload, comparison) in zip(axes, comparisons.items(), strict=True):
        costs = answer_costs(comparison)
        x, bottom = np.arange(len(costs)), np.zeros(len(costs))
        for key, (legend, colour) in parts.items():
            heights = np.array([cost[key] for cost in costs])
            ax.bar(x, heights, bottom=bottom, color=colour, label=legend)
            bottom += heights
        for i, cost in enumerate(costs):
            if cost["against"] is not None:
                ax.annotate(f"{cost['against']:.2f}×", (i, bottom[i]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [cost["label"].replace(", ", ",\n") for cost in costs], fontsize=8)
        ax.set_ylabel("core-ms per answer")
        ax.set_title(f"`{workload}`: CPU per answer (× chapter 8 alone at the same runs)")
        ax.grid(True, axis="y", alpha=0.3)
    figure = axes[0].figure
    figure.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=len(parts))
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    return figure


def plot_simulated_scaling(results: Mapping, mix: str = "mixed"):
    """The simulation of 1 to 64 replicas: P99 and goodput per replica against replicas, per router, at 85 % and
    95 % of capacity (``benchmarks.report.scale_out_simulation_plots.plot_scaling``)."""
    from benchmarks.report.scale_out_simulation_plots import plot_scaling

    axes = Figure(figsize=(12, 9)).subplots(2, 2)
    for row, utilisation in enumerate((0.85, 0.95)):
        plot_scaling(results, axes[row][0], axes[row][1], mix=mix, utilisation=utilisation)
    axes[0][0].figure.tight_layout()
    return axes[0][0].figure
