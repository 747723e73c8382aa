"""Where load stops buying throughput: the closed loop's saturation and the open loop's knee.

- *saturation* (:func:`find_knee`), closed loop: the lowest load at which QPS reaches 90 % of the
  best QPS measured, where more users stop buying throughput and only wait. A closed loop's latency
  grows with its users by construction (each user waits for the ones before it), so "P99 doubled"
  would mark the first step up for every chapter, not a limit; the load to size by is the open
  loop's knee, below.
- *open-loop knee* (:func:`find_open_knee`): the highest offered rate before the first rate at which
  P99 exceeds three times its value at the lowest rate, or the achieved rate falls below 95 % of the
  rate at which requests actually arrived, or more than 1 % of the arrivals fail. Up to the knee, latency grows slowly with the
  load (the server keeps up); past it, requests queue faster than they are served and latency
  avalanches (the article's section 6.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.results import BenchmarkResult, OpenLoopResult


SATURATION_SHARE = 0.9  # a closed loop saturates where QPS reaches this share of its best
OPEN_P99_KNEE_FACTOR = 3.0  # a low rate's P99 rests on few requests: a factor of 2 would trip on noise
OPEN_MIN_ACHIEVED_SHARE = 0.95
OPEN_MAX_ERROR_SHARE = 0.01


@dataclass(frozen=True)
class Knee:
    """``index`` into the levels (sorted by load); ``reasons`` empty when saturation lies beyond the loads tested."""

    index: int
    users: int
    reasons: tuple[str, ...]  # "saturated": a higher load was measured and bought little more QPS

    @property
    def reached(self) -> bool:
        return bool(self.reasons)


def find_knee(users: Sequence[int], qps: Sequence[float], *, share: float = SATURATION_SHARE) -> Knee:
    """The closed loop's saturation: the lowest load whose QPS reaches ``share`` of the best measured.

    Levels must be sorted by ``users``. Past that load more users add at most ``1 / share - 1`` of
    throughput (11 % at 0.9) and only queue. When it is the highest load tested, the reasons are
    empty: the server may saturate beyond it.
    """
    if not users:
        raise ValueError("no levels")
    if list(users) != sorted(users):
        raise ValueError(f"levels must be sorted by load, got {list(users)}")
    best = max(qps)
    index = next(i for i, q in enumerate(qps) if q >= share * best)
    return Knee(index=index, users=users[index], reasons=("saturated",) if index < len(users) - 1 else ())


def knee_of(result: BenchmarkResult) -> Knee | None:
    levels = sorted((lvl for lvl in result.levels if lvl.latency_ms is not None), key=lambda lvl: lvl.users)
    if not levels:
        return None
    return find_knee([lvl.users for lvl in levels], [lvl.qps for lvl in levels])


@dataclass(frozen=True)
class OpenKnee:
    """``index`` into the rates (sorted); -1 when even the lowest rate broke. ``reasons`` empty when no rate broke."""

    index: int
    rate: float | None  # None: below the lowest rate measured
    reasons: tuple[str, ...]  # "p99_tripled", "achieved_below_offered", "errors"
    broke_at: float | None  # the first rate that broke

    @property
    def reached(self) -> bool:
        return bool(self.reasons)


def find_open_knee(
    rates: Sequence[float], achieved: Sequence[float], arrived: Sequence[float], p99_ms: Sequence[float | None],
    error_share: Sequence[float],
    *, p99_factor: float = OPEN_P99_KNEE_FACTOR, min_achieved: float = OPEN_MIN_ACHIEVED_SHARE,
    max_error_share: float = OPEN_MAX_ERROR_SHARE,
) -> OpenKnee:
    """The highest offered rate before the first one that breaks; rates must be sorted upward.

    Rate ``i`` breaks when ``p99_ms[i] > p99_factor * p99_ms[0]`` (``i >= 1``; no P99 at all also
    breaks), ``achieved[i] < min_achieved * arrived[i]`` (the server no longer keeps up with the
    requests that actually arrived: a Poisson draw strays from the nominal rate, by about 20 % for 25
    arrivals, so the nominal rate would trip on chance), or ``error_share[i] > max_error_share``. The knee is rate ``i - 1`` (``None`` with index -1 when the
    lowest rate already breaks); when nothing breaks it is the top rate, with no reasons.
    """
    if not rates:
        raise ValueError("no rates")
    if list(rates) != sorted(rates):
        raise ValueError(f"rates must be sorted upward, got {list(rates)}")
    baseline = p99_ms[0]
    for i, rate in enumerate(rates):
        reasons = []
        if p99_ms[i] is None or (i >= 1 and baseline is not None and p99_ms[i] > p99_factor * baseline):
            reasons.append("p99_tripled")
        if achieved[i] < min_achieved * arrived[i]:
            reasons.append("achieved_below_offered")
        if error_share[i] > max_error_share:
            reasons.append("errors")
        if reasons:
            return OpenKnee(index=i - 1, rate=rates[i - 1] if i else None, reasons=tuple(reasons), broke_at=rate)
    return OpenKnee(index=len(rates) - 1, rate=rates[-1], reasons=(), broke_at=None)


def open_knee_of(result: OpenLoopResult) -> OpenKnee | None:
    levels = sorted(result.levels, key=lambda level: level.offered_rps)
    if not levels:
        return None
    return find_open_knee(
        [lvl.offered_rps for lvl in levels], [lvl.qps for lvl in levels], [lvl.arrival_rps for lvl in levels],
        [lvl.latency_ms.p99 if lvl.latency_ms else None for lvl in levels], [lvl.error_share for lvl in levels],
    )


def describe_open_knee(knee: OpenKnee | None) -> str:
    if knee is None:
        return "—"
    if not knee.reached:
        return f"> {knee.rate:g}/s"
    if knee.rate is None:
        return f"< {knee.broke_at:g}/s"
    return f"{knee.rate:g}/s"
