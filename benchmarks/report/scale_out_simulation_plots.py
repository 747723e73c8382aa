"""Figures of chapter 9's scale-out simulation (:mod:`chapters.ch09_scale_out.simulation`), drawn on axes the caller owns.

No pyplot state: a notebook makes a :class:`matplotlib.figure.Figure`, its axes, and hands them
here, so the same function serves a notebook, a report and a test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.axes import Axes

ROUTER_STYLE: dict[str, dict[str, Any]] = {
    "random": {"color": "tab:red", "marker": "o"},
    "pow2": {"color": "tab:blue", "marker": "s"},
    "least-tokens": {"color": "tab:green", "marker": "^"},
    "least-remaining": {"color": "tab:purple", "marker": "v"},
}


def scaling_points(results: Mapping[str, Any], mix: str, utilisation: float, router: str) -> list[Mapping[str, Any]]:
    """The sweep's points of one mix, utilisation and router, by replica count (empty when the sweep has none)."""
    points = [p for p in results["points"]
              if p["mix"] == mix and p["router"] == router and abs(p["utilisation"] - utilisation) < 1e-9]
    return sorted(points, key=lambda p: p["replicas"])


def plot_scaling(results: Mapping[str, Any], ax_p99: Axes, ax_goodput: Axes, *, mix: str = "mixed",
                 utilisation: float = 0.85, routers: Sequence[str] | None = None, ttft: bool = True) -> None:
    """P99 latency and goodput against the number of replicas, one line per router.

    ``results``: the document the study ``python -m benchmarks.studies.scale_out_simulation.sweep`` writes. On
    ``ax_p99``: P99 of the whole answer (solid) and, with ``ttft``, P99 of the time to first
    token (dotted), in seconds, log scale. On ``ax_goodput``: goodput per replica (requests/s
    within the SLO), with the offered rate per replica dashed in grey: the gap is what missed the SLO.
    Raises ``ValueError`` when the sweep holds no point of ``mix`` at ``utilisation``.
    """
    routers = list(routers or results["settings"]["routers"])
    drawn = False
    offered_per_replica: list[tuple[int, float]] = []
    for router in routers:
        points = scaling_points(results, mix, utilisation, router)
        if not points:
            continue
        drawn = True
        replicas = [p["replicas"] for p in points]
        style = ROUTER_STYLE.get(router, {})
        ax_p99.plot(replicas, [p["latency_ms"]["p99"] / 1e3 for p in points], label=f"{router}: answer P99", **style)
        if ttft:
            ax_p99.plot(replicas, [p["ttft_ms"]["p99"] / 1e3 for p in points], linestyle=":", label=f"{router}: TTFT P99",
                        **style)
        ax_goodput.plot(replicas, [p["goodput_rps"] / p["replicas"] for p in points], label=router, **style)
        offered_per_replica = [(p["replicas"], p["offered_rps"] / p["replicas"]) for p in points]
    if not drawn:
        raise ValueError(f"the sweep has no point of mix {mix!r} at utilisation {utilisation}")
    ax_goodput.plot([r for r, _ in offered_per_replica], [rate for _, rate in offered_per_replica], linestyle="--",
                    color="grey", label="offered")
    slo = results["settings"]["slo"]
    for ax in (ax_p99, ax_goodput):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.grid(True, which="both", alpha=0.3)
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("P99 latency (s)")
    ax_p99.set_title(f"{mix}, {utilisation:.0%} of capacity: P99")
    ax_goodput.set_ylabel("goodput per replica (requests/s)")
    ax_goodput.set_title(f"goodput (TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.0f} ms)")
    ax_goodput.set_ylim(bottom=0)
    ax_p99.legend(fontsize="small")
    ax_goodput.legend(fontsize="small")
