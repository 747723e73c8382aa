"""Chapter 7: the drain around a SIGTERM, the leak check's memory curve.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.report.notebook_plots.common import MissingData, repo_relative, results_dir


# --------------------------------------------------------------------------------------------
# Chapter 7: the drain around a SIGTERM, the leak check's memory curve
# --------------------------------------------------------------------------------------------

PRODUCTION_DIR = "ch07"  # under the results directory
DRAIN_FILE = "drain-timeline.json"
LEAK_LESSONS = ("leaky", "fixed")


def drain_command(directory: Path) -> str:
    return f"python -m benchmarks.studies.drain_timeline.drain_timeline --out {repo_relative(Path(directory) / PRODUCTION_DIR / DRAIN_FILE)}"


def leak_command(directory: Path, lesson: str) -> str:
    out = repo_relative(Path(directory) / PRODUCTION_DIR / f"leak-{lesson}.json")
    return (f"python -m chapters.ch07_production.leakcheck --requests 2000 --fail-share 0.2 --samples 20 "
            f"--leak-lesson {lesson} --out {out}")


def load_drain_timeline(directory: Path) -> dict:
    """The recorder's timeline (``benchmarks/studies/drain_timeline/drain_timeline.py``) in ``directory/ch07/``."""
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
