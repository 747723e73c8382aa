"""Read what a server says about itself while it is loaded: batch sizes, pool and admission figures.

The harness (never Locust) polls the server's ``GET /stats`` every ``interval_s`` from a background
thread, plus once just before and once just after a level. Chapters that have no ``/stats`` but report
their batcher under ``GET /healthz`` (``{"batcher": {...}}``) are read there; a chapter with neither
(chapter 1) is not polled at all, so a synchronous server's only worker is never asked for anything
but inference.

The batcher's counters are cumulative since the server started (``batches``, ``requests``,
``batch_sizes``: size -> batches of that size), so a level's own figures are the difference between
the snapshots around it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import requests

from benchmarks.harness.results import MAX_SERIES_POINTS, ServerSeries
from benchmarks.harness.summaries import evenly_chosen

Source = Literal["stats", "healthz"]
POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0


def detect_source(url: str, timeout_s: float = POLL_TIMEOUT_S) -> Source | None:
    """``stats`` when ``GET /stats`` answers 200 with a JSON object, else ``healthz`` when ``/healthz``
    carries a ``batcher`` object, else ``None`` (nothing to record)."""
    for source in ("stats", "healthz"):
        try:
            response = requests.get(f"{url}/{source if source == 'stats' else 'healthz'}", timeout=timeout_s)
            body = response.json() if response.status_code == 200 else None
        except (requests.RequestException, ValueError):
            continue
        if isinstance(body, dict) and (source == "stats" or isinstance(body.get("batcher"), dict)):
            return source
    return None


def read_figures(url: str, source: Source, timeout_s: float = POLL_TIMEOUT_S) -> dict[str, Any] | None:
    """The server's figures in ``/stats``'s layout (``/healthz``'s batcher under ``batcher``); None on failure."""
    try:
        response = requests.get(f"{url}/{source if source == 'stats' else 'healthz'}", timeout=timeout_s)
        body = response.json() if response.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    return body if source == "stats" else {"batcher": body.get("batcher") or {}}


def server_choices(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """What the server says of itself in ``/stats`` at the end of a run: the engine and attention its
    start-up rules chose and its prefix cache's counters (over its whole run, warm-up included), where
    it has them (chapter 5's engine from chapter 5 on, chapter 8's attention and prefix cache); empty
    when it says nothing. A rule that measures at start-up can choose differently on another day, so
    every result keeps what its server ran."""
    figures = read_figures(url, "stats", timeout_s)
    if figures is None:
        return {}
    scheduler, engine = figures.get("scheduler"), figures.get("engine")
    chosen = {"prefix_cache": scheduler.get("prefix_cache") if isinstance(scheduler, Mapping) else None,
              "attention": figures.get("attention"),
              "engine": {k: engine.get(k) for k in ("engine", "precision", "dtype")} if isinstance(engine, Mapping) else None}
    return {key: value for key, value in chosen.items() if value is not None}


def flatten_numbers(figures: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of ``figures`` as ``{"pool.blocks_used": 12.0}``; booleans, text and the
    ``batch_sizes`` histogram (kept apart) left out."""
    flat: dict[str, float] = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if key == "batch_sizes":
            continue
        if isinstance(value, Mapping):
            flat.update(flatten_numbers(value, f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def batch_counters(figures: Mapping[str, Any] | None) -> tuple[dict[str, int], int | None, int | None]:
    """``(batch_sizes, batches, requests)`` of a snapshot's batcher; empty where there is none."""
    batcher = (figures or {}).get("batcher")
    if not isinstance(batcher, Mapping):
        return {}, None, None
    sizes = {str(size): int(count) for size, count in (batcher.get("batch_sizes") or {}).items()}
    return sizes, batcher.get("batches"), batcher.get("requests")


def histogram_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """``after - before`` per batch size, sizes with no new batch left out, sorted by size."""
    delta = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    if any(count < 0 for count in delta.values()):
        raise ValueError(f"batch counters went down ({dict(before)} -> {dict(after)}): did the server restart?")
    return {size: count for size, count in sorted(delta.items(), key=lambda item: int(item[0])) if count}


@dataclass
class StatsPoller:
    """Snapshots around a level and polls during it, from a thread; :meth:`series` builds the level's record."""

    url: str
    source: Source
    interval_s: float = POLL_INTERVAL_S
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    polls: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (wall time, flattened figures)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StatsPoller:
        self.before = read_figures(self.url, self.source)
        self._take(self.before)
        self._thread = threading.Thread(target=self._run, name="stats-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        self.after = read_figures(self.url, self.source)
        self._take(self.after)

    def _take(self, figures: dict[str, Any] | None) -> None:
        if figures is not None:
            self.polls.append((time.time(), flatten_numbers(figures)))

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self._take(read_figures(self.url, self.source))

    def series(self, window_start: float, max_points: int = MAX_SERIES_POINTS) -> ServerSeries:
        """The level's record: the batch-size histogram's delta and the polls (times from ``window_start``)."""
        before_sizes, before_batches, before_requests = batch_counters(self.before)
        after_sizes, after_batches, after_requests = batch_counters(self.after)
        both = self.before is not None and self.after is not None
        chosen = evenly_chosen(self.polls, max_points)
        names = {name for _, figures in chosen for name in figures}
        constants = {
            name: chosen[0][1][name] for name in names
            if all(name in figures and figures[name] == chosen[0][1].get(name) for _, figures in chosen)
        }
        return ServerSeries(
            source=self.source,
            interval_s=self.interval_s,
            batch_sizes=histogram_delta(before_sizes, after_sizes) if both else {},
            batches=after_batches - before_batches if both and None not in (before_batches, after_batches) else None,
            requests=after_requests - before_requests if both and None not in (before_requests, after_requests) else None,
            points=[
                {"t_s": round(at - window_start, 3), **{k: v for k, v in figures.items() if k not in constants}}
                for at, figures in chosen
            ],
            constants=dict(sorted(constants.items())),
            steps=list(((self.after or {}).get("steps") or {}).get("recent") or []),
        )
