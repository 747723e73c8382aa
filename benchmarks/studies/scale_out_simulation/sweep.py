"""The scale-out simulation's sweep: chapter 9's model of replicas and routers, run over routers x replicas x loads x mixes.

    python -m benchmarks.studies.scale_out_simulation.sweep --out benchmarks/reference/cpu/ch09/simulation.json

The model (:mod:`chapters.ch09_scale_out.simulation`: queues, routers, :func:`~chapters.ch09_scale_out.simulation.simulate`)
lives in the chapter; this script decides what to run and what to measure of each run: the load
offered (a share of one replica's capacity, :func:`~chapters.ch09_scale_out.simulation.replica_capacity`),
how long a point runs and which requests count (:func:`measured_window`), the latencies, goodput and
occupancy of each point (:func:`summarise`), one simulated replica against chapter 8's measured open
loop, the step model against the server's own step records, and the assumptions as sentences
(:func:`assumptions`), all written into one JSON file. The step model it reads is
``measure_steps.py``'s (``benchmarks/reference/cpu/ch09/step-times.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from chapters.ch04_memory_pool.server import AdmissionOptions
from chapters.ch08_continuous_batching.scheduler import SchedulerConfig
from chapters.ch09_scale_out.simulation import (
    DEFAULT_SEED,
    DEFAULT_STEP_TIMES,
    MIXED_NEW_TOKENS,
    MIXES,
    ROUTER_FACTORIES,
    ROUTERS,
    Outcome,
    ReplicaConfig,
    RequestMix,
    Requests,
    StepTimeModel,
    replica_capacity,
    simulate,
    stable_seed,
)
from shared.paths import REPO_ROOT

REPLICA_COUNTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
# Offered load as a fraction of what the replicas can serve; the article's lesson sits at 0.85.
UTILISATIONS: tuple[float, ...] = (0.5, 0.7, 0.85, 0.95)

# Chapter 4's queue bound: a replica holds at most max_num_seqs + max_queue requests, which is what
# chapter 9 gives Serve as max_ongoing_requests.
MAX_QUEUE: int = AdmissionOptions.model_fields["max_queue"].default

# The SLO of chapter 8's streaming comparison (its README: --slo-ttft-ms 1000 --slo-tpot-ms 100):
# a request counts toward goodput when its first token came within TTFT and its later tokens,
# on average, within TPOT each (vLLM's goodput definition).
SLO_TTFT_MS = 1000.0
SLO_TPOT_MS = 100.0

DEFAULT_OUT = Path("benchmarks/reference/cpu/ch09/simulation.json")
OPEN_LOOP_REFERENCE = Path("benchmarks/reference/cpu/openloop/ch08.json")
COMMAND = "python -m benchmarks.studies.scale_out_simulation.sweep"

# Requests measured: those arriving between these fractions of the arrival span. The first 10 %
# fill the empty replicas (a start-up transient); after the last 10 % the arrivals stop and the
# queues drain faster than in steady state.
MEASURED_WINDOW: tuple[float, float] = (0.1, 0.9)
# ... and no request before WARMUP_S: a 256-token answer takes seconds, and 64 replicas take that
# long to fill however many requests the first 10 % are. Each point simulates at least
# MIN_REQUESTS requests (for its P99) and MIN_DURATION_S seconds of arrivals (for a steady state
# past the warm-up). Both seconds are for the mixed workload's 256-token answers; simulated_seconds
# shortens them for a mix of shorter answers.
WARMUP_S = 8.0
MIN_REQUESTS = 8_000
MIN_DURATION_S = 30.0



# -- what a point measured ------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    """A request is good when its time to first token and its mean time per later token are within these."""

    ttft_ms: float = SLO_TTFT_MS
    tpot_ms: float = SLO_TPOT_MS


def measured_window(requests: Requests, fractions: tuple[float, float] = MEASURED_WINDOW,
                    warmup_s: float = 0.0) -> tuple[slice, tuple[float, float]]:
    """The requests measured (an index slice) and the time window they arrive in (s).

    The window opens after the first ``fractions[0]`` of the arrivals and no earlier than
    ``warmup_s``, and closes after ``fractions[1]`` of them.
    """
    count = len(requests)
    arrivals = requests.arrival_s
    last = min(max(int(count * fractions[1]), 1), count - 1)
    first = max(int(count * fractions[0]), int(np.searchsorted(arrivals, warmup_s)))
    if first >= last:
        raise ValueError(f"no request arrives between {warmup_s} s (or {fractions[0]:.0%} of them) and {fractions[1]:.0%} of them")
    return slice(first, last), (float(arrivals[first]), float(arrivals[last]))


def summarise(outcome: Outcome, measured: slice, window: tuple[float, float], max_num_seqs: int,
              slo: Slo = Slo(), replica_limit: int = SchedulerConfig.max_num_seqs + MAX_QUEUE) -> dict[str, Any]:
    """The metrics of one simulated point, over the ``measured`` requests and the ``window`` (s) they arrived in.

    Latencies in milliseconds: ``latency`` arrival to last token, ``ttft`` arrival to first token,
    ``tpot`` (last - first) / (answer - 1) for answers of 2 tokens or more, ``queue`` arrival to the
    first step that computed it. ``goodput_rps``: measured requests within ``slo``, per second of
    the window. ``busy_fraction``: per replica, the share of the window spent in steps;
    ``batch_occupancy``: per replica, running sequences over ``max_num_seqs`` averaged over the
    window (both as mean, min and max over the replicas).
    ``over_replica_limit_share``: measured requests whose replica already held ``replica_limit``
    (what chapter 9 gives Serve as ``max_ongoing_requests``; Serve would have held them at its proxy).
    """
    r = outcome.requests
    arrival = r.arrival_s[measured]
    latency = (outcome.finished_s[measured] - arrival) * 1e3
    ttft = (outcome.first_token_s[measured] - arrival) * 1e3
    queue = (outcome.started_s[measured] - arrival) * 1e3
    answers = r.answer_tokens[measured]
    several = answers > 1
    tpot = np.full(len(answers), 0.0)
    tpot[several] = (outcome.finished_s[measured][several] - outcome.first_token_s[measured][several]) * 1e3 / (answers[several] - 1)
    good = (ttft <= slo.ttft_ms) & (tpot <= slo.tpot_ms)
    span = window[1] - window[0]
    finished_in_window = np.count_nonzero((outcome.finished_s >= window[0]) & (outcome.finished_s < window[1]))
    busy = outcome.replica_busy_s / span
    occupancy = outcome.replica_running_s / span / max_num_seqs

    def pct(values: np.ndarray, q: float) -> float:
        return round(float(np.percentile(values, q)), 1)

    return {
        "requests_measured": int(len(arrival)),
        "throughput_rps": round(finished_in_window / span, 2),
        "latency_ms": {"p50": pct(latency, 50), "p90": pct(latency, 90), "p99": pct(latency, 99), "max": pct(latency, 100)},
        "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_ms": {"p50": pct(tpot[several], 50), "p99": pct(tpot[several], 99)} if several.any() else None,
        "queue_ms": {"p50": pct(queue, 50), "p99": pct(queue, 99)},
        "goodput_rps": round(int(good.sum()) / span, 2),
        "goodput_share": round(float(good.mean()), 4),
        "busy_fraction": {"mean": round(float(busy.mean()), 3), "min": round(float(busy.min()), 3), "max": round(float(busy.max()), 3)},
        "batch_occupancy": {"mean": round(float(occupancy.mean()), 3), "min": round(float(occupancy.min()), 3),
                            "max": round(float(occupancy.max()), 3)},
        "over_replica_limit_share": round(float(np.mean(outcome.in_flight_at_arrival[measured] >= replica_limit)), 4),
    }


def simulated_seconds(mix: RequestMix) -> tuple[float, float]:
    """``(warm-up, minimum seconds of arrivals)`` for ``mix``.

    ``WARMUP_S`` and ``MIN_DURATION_S`` are set for answers of up to 256 tokens (the mixed
    workload); replicas fill and settle sooner when the longest answer is shorter, in proportion,
    down to a third of them.
    """
    longest = max(mix.answer_lengths) if mix.answer_lengths else mix.log_uniform_answers[1]
    scale = min(1.0, max(longest / MIXED_NEW_TOKENS[1], 1 / 3))
    return WARMUP_S * scale, MIN_DURATION_S * scale


def mean_decode_context(mix: RequestMix, seed: int = DEFAULT_SEED, count: int = 20_000) -> float:
    """Positions a decode row of ``mix`` attends to, on average over all decode steps (prompt + tokens so far).

    A request of prompt ``p`` and answer ``a`` decodes ``a - 1`` times, at ``p + 1`` ... ``p + a - 1`` positions.
    """
    prompts, answers, _ = mix.draw(np.random.default_rng([seed, stable_seed(mix.name), 1]), count)
    decodes = answers - 1
    return float(np.sum(decodes * prompts + decodes * (decodes + 1) / 2) / np.sum(decodes))


# -- the sweep ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One simulated configuration of the sweep."""

    mix: str
    router: str
    replicas: int
    utilisation: float
    capacity_rps: float  # one replica's
    requests: int
    seed: int


def point_requests(point: Point) -> Requests:
    """The point's arrivals: the same for every router at the same mix, replicas and utilisation (common random numbers)."""
    rng = np.random.default_rng([point.seed, stable_seed(point.mix), point.replicas, round(point.utilisation * 1000)])
    return Requests.poisson(MIXES[point.mix], point.replicas * point.utilisation * point.capacity_rps, point.requests, rng)


def run_point(point: Point, config: ReplicaConfig, slo: Slo = Slo()) -> dict[str, Any]:
    """Simulate ``point`` and summarise it (one row of the sweep's ``points``)."""
    requests = point_requests(point)
    measured, window = measured_window(requests, warmup_s=simulated_seconds(MIXES[point.mix])[0])
    router_seed = np.random.SeedSequence([point.seed, stable_seed(point.router), point.replicas, round(point.utilisation * 1000)])
    outcome = simulate(requests, point.router, point.replicas, config, seed=int(router_seed.generate_state(1)[0]), window=window)
    offered = point.replicas * point.utilisation * point.capacity_rps
    return {"mix": point.mix, "router": point.router, "replicas": point.replicas, "utilisation": point.utilisation,
            "offered_rps": round(offered, 2), "requests_simulated": point.requests,
            **summarise(outcome, measured, window, config.max_num_seqs, slo)}


def requests_for(offered_rps: float, min_requests: int = MIN_REQUESTS, min_duration_s: float = MIN_DURATION_S) -> int:
    """Enough requests for a P99 (``min_requests``) and for a steady state (``min_duration_s`` of arrivals)."""
    return max(min_requests, math.ceil(offered_rps * min_duration_s))


def _run_point_star(args: tuple[Point, ReplicaConfig, Slo]) -> dict[str, Any]:
    return run_point(*args)


def assumptions(config: ReplicaConfig, slo: Slo, step_times: str) -> list[str]:
    """What the simulation assumes, as plain sentences (written into the sweep's JSON)."""
    return [
        f"Each replica is chapter 8's continuous batcher reduced to its arithmetic: at most {config.max_num_seqs} sequences "
        f"run at once (max_num_seqs) and a step computes at most {config.max_num_batched_tokens} tokens (max_num_batched_tokens); "
        "every running sequence whose prompt is computed decodes one token per step, then prompts already admitted continue, "
        "then waiting requests are admitted first come first served, a prompt longer than the budget left being chunked.",
        "A prompt's last chunk yields the first token; a request leaves at the end of the step that made its last token, and "
        "a request that arrives during a step waits for that step to end.",
        f"A step's duration depends only on what it computes: its decode rows, the positions they attend to (each row's "
        f"prompt plus the tokens it has so far) and its prompt tokens, by the formula of StepTimeModel with the constants "
        f"fitted from chapter 8's engine step timed in-process on this machine ({step_times}): chapter 8's default settings, "
        "one torch thread, no HTTP. A prompt chunk costs the same whatever history precedes it.",
        "Every replica has a core of its own, so its step time is the measured one whatever the other replicas do: 64 "
        "replicas are 64 such cores, not this machine's two, with no contention for memory bandwidth between them.",
        "Nothing but the step loop takes time: no HTTP, no event loop sharing the interpreter with the step thread, no "
        "network between router and replica, no proxy hop. The validation block compares one simulated replica with "
        "chapter 8's measured open loop to show what this leaves out.",
        "The KV pool never runs short (chapter 4's rule sizes it for max_num_seqs sequences at the full context), so no "
        "sequence is ever preempted, and no request is cancelled, times out or fails.",
        "Arrivals are a Poisson process. The offered rate is replicas x utilisation x one replica's capacity, where capacity "
        "is the requests/s one simulated replica finishes when it is never short of waiting requests (a full batch).",
        "Queues are unbounded: no request is refused (429) or held at Serve's proxy. over_replica_limit_share counts the "
        f"measured requests whose replica already held max_num_seqs + max_queue = {config.max_num_seqs + MAX_QUEUE} requests, "
        "chapter 9's max_ongoing_requests, where Serve would have held them at the proxy instead.",
        "Routers decide instantly, from exact counters as each replica's last step left them. random draws a replica "
        "uniformly; pow2 (Serve's default) draws two distinct replicas and takes the one with fewer requests in flight, "
        "the first drawn on a tie; least-tokens and least-remaining look at every replica (one router that sees them all) "
        "and take the one with the fewest tokens by their count, ties going to the first at or after a random offset.",
        "least-tokens counts what chapter 9's router counts: each request's prompt plus max_new_tokens, from when it is "
        "routed until it finishes (a proxy sees requests leave, not their progress). least-remaining counts what a replica "
        "could report: for each request, its prompt tokens not yet prefilled plus max_new_tokens minus the tokens generated "
        "so far. Both know what each request asks for, not how long its answer will be. In the mixed and default mixes a "
        "request asks exactly its answer's length (chapter 8 generates exactly max_new_tokens); in mixed-capped every "
        "request asks 256 tokens and stops at its answer, so both over-count.",
        f"Latency runs from arrival at the router to the end of the step that made the last token. Measured requests are "
        f"those arriving after the first {MEASURED_WINDOW[0]:.0%} of the arrivals and after a warm-up ({WARMUP_S:.0f} s "
        f"for answers of up to 256 tokens, less in proportion for shorter ones, down to a third: empty replicas filling "
        f"up), and before the last {1 - MEASURED_WINDOW[1]:.0%} (queues draining once arrivals stop). Each point simulates "
        f"at least {MIN_REQUESTS} requests and {MIN_DURATION_S:.0f} s of arrivals (scaled as the warm-up): a short run "
        "understates the tail of a router that lets queues grow slowly, as random does near capacity.",
        f"Goodput is the measured requests per second whose time to first token is at most {slo.ttft_ms:.0f} ms and whose "
        f"time per later token is at most {slo.tpot_ms:.0f} ms on average (the SLO of chapter 8's streaming comparison).",
        "One seed makes every figure reproducible; at a given mix, replica count and utilisation every router sees the same "
        "arrivals and the same request sizes.",
    ]


def environment() -> dict[str, Any]:
    """The machine and the code, in the words the harness's environment records them (without torch, which the sweep does not need)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/reference")
    cpu_model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    try:
        torch_version = metadata.version("torch")
    except Exception:  # noqa: BLE001 - a description, never a reason to fail
        torch_version = None
    return {
        "git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status),
        "python": platform.python_version(), "torch": torch_version, "numpy": np.__version__,
        "platform": platform.platform(), "cpu_model": cpu_model, "logical_cores": os.cpu_count() or 1,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def _repo_path(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def validate_against_open_loop(config: ReplicaConfig, open_loop: Path, seed: int, count: int = 4000) -> dict[str, Any]:
    """One simulated replica at the offered rates of chapter 8's measured open loop, beside what was measured.

    The open loop's server ran the ``default`` workload on one pinned core with HTTP, Locust on the
    other; the simulation has neither, so the difference is what the model leaves out.
    """
    document = json.loads(Path(open_loop).read_text())
    rows = []
    for level in document["levels"]:
        rate = float(level["offered_rps"])
        rng = np.random.default_rng([seed, stable_seed("validation"), round(rate * 1000)])
        requests = Requests.poisson(MIXES["default"], rate, count, rng)
        measured, window = measured_window(requests, warmup_s=simulated_seconds(MIXES["default"])[0])
        outcome = simulate(requests, "random", 1, config, seed, window=window)
        simulated = summarise(outcome, measured, window, config.max_num_seqs)
        rows.append({
            "offered_rps": rate,
            "measured": {"qps": round(level["qps"], 2), "p50_ms": round(level["latency_ms"]["p50"], 1),
                         "p99_ms": round(level["latency_ms"]["p99"], 1), "requests": level["requests_ok"]},
            "simulated": {"throughput_rps": simulated["throughput_rps"], "p50_ms": simulated["latency_ms"]["p50"],
                          "p99_ms": simulated["latency_ms"]["p99"], "batch_occupancy": simulated["batch_occupancy"]["mean"]},
        })
    return {"source": _repo_path(open_loop), "workload": "default", "requests_per_rate": count, "levels": rows}


def validate_step_model(model: StepTimeModel, result_files: Sequence[Path], context_per_row: float) -> dict[str, Any]:
    """The step model against the step records chapter 8's server kept under load (``server_series.steps``).

    Those records lack the positions each decode row attended to, so the prediction gives every
    row ``context_per_row`` positions; the ratio is recorded / predicted.
    """
    ratios = []
    used = []
    for path in result_files:
        if not Path(path).exists():
            continue
        document = json.loads(Path(path).read_text())
        used.append(_repo_path(path))
        for level in document.get("levels", []):
            for record in (level.get("server_series") or {}).get("steps") or []:
                rows, prefill = int(record["decode_rows"]), int(record["prefill_tokens"])
                recorded = record["schedule_ms"] + record["prepare_ms"] + record["model_ms"] + record["update_ms"]
                predicted = model.step_ms(rows, prefill, context_per_row * rows)
                ratios.append(recorded / predicted)
    if not ratios:
        return {"sources": used, "records": 0}
    q25, q50, q75 = np.percentile(ratios, [25, 50, 75])
    return {"sources": used, "records": len(ratios), "context_per_row_assumed": round(context_per_row, 1),
            "recorded_over_predicted": {"p25": round(float(q25), 3), "median": round(float(q50), 3), "p75": round(float(q75), 3)}}


def sweep(config: ReplicaConfig, *, mixes: Sequence[str] = tuple(MIXES), routers: Sequence[str] = ROUTERS,
          replica_counts: Sequence[int] = REPLICA_COUNTS, utilisations: Sequence[float] = UTILISATIONS,
          seed: int = DEFAULT_SEED, min_requests: int = MIN_REQUESTS, min_duration_s: float = MIN_DURATION_S,
          slo: Slo = Slo(), workers: int = 1) -> dict[str, Any]:
    """Every (mix, router, replicas, utilisation) point, with each mix's one-replica capacity; deterministic for ``seed``."""
    capacities = {mix: replica_capacity(MIXES[mix], config, seed) for mix in mixes}
    scale = {mix: simulated_seconds(MIXES[mix])[1] / MIN_DURATION_S for mix in mixes}
    points = [Point(mix, router, replicas, utilisation, capacities[mix],
                    requests_for(replicas * utilisation * capacities[mix], min_requests, min_duration_s * scale[mix]), seed)
              for mix in mixes for router in routers for replicas in replica_counts for utilisation in utilisations]
    jobs = [(point, config, slo) for point in points]
    if workers > 1:
        # The biggest points first, so that no worker is left with one of them at the end.
        order = sorted(range(len(jobs)), key=lambda i: -points[i].requests)
        with ProcessPoolExecutor(workers) as pool:
            done = dict(zip(order, pool.map(_run_point_star, [jobs[i] for i in order], chunksize=1)))
        rows = [done[i] for i in range(len(jobs))]
    else:
        rows = [_run_point_star(job) for job in jobs]
    return {
        "mixes": {mix: {"description": MIXES[mix].description, "capacity_rps_per_replica": round(capacities[mix], 2),
                        "warmup_s": round(simulated_seconds(MIXES[mix])[0], 2),
                        "min_arrival_s": round(min_duration_s * scale[mix], 2)}
                  for mix in mixes},
        "points": rows,
    }


def run(step_times: Path, out: Path, seed: int = DEFAULT_SEED, workers: int = 2, min_requests: int = MIN_REQUESTS,
        min_duration_s: float = MIN_DURATION_S, open_loop: Path = OPEN_LOOP_REFERENCE,
        routers: Sequence[str] = ROUTERS) -> dict[str, Any]:
    """The ``run`` command: the sweep, the validations, the assumptions and the inputs, written to ``out``."""
    started = time.perf_counter()
    model = StepTimeModel.from_file(step_times)
    config = ReplicaConfig(model)
    slo = Slo()
    result = sweep(config, routers=routers, seed=seed, workers=workers, min_requests=min_requests,
                   min_duration_s=min_duration_s, slo=slo)
    document = {
        "what": "chapter 8's continuous batcher as 1 to 64 replicas behind three routers, simulated under Poisson arrivals",
        "command": (f"{COMMAND} --step-times {_repo_path(step_times)} "
                    f"--out {_repo_path(out)} --seed {seed}" + ("" if tuple(routers) == ROUTERS else f" --routers {' '.join(routers)}")),
        "seed": seed,
        "inputs": {
            "step_times": _repo_path(step_times),
            "request_mixes": ["benchmarks/workload.py (prompt lengths, the default workload's 32 new tokens)",
                              "benchmarks/streaming.py (the mixed workload's answers, 8 to 256 tokens, log-uniform)"],
            "validation": [_repo_path(open_loop), _repo_path(REPO_ROOT / "benchmarks/reference/cpu/ch08.json")],
        },
        "assumptions": assumptions(config, slo, _repo_path(step_times)),
        "settings": {
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_queue": MAX_QUEUE, "routers": list(routers), "replicas": list(REPLICA_COUNTS),
            "utilisations": list(UTILISATIONS), "slo": asdict(slo), "min_requests": min_requests,
            "min_duration_s": min_duration_s, "warmup_s": WARMUP_S, "measured_arrival_fractions": list(MEASURED_WINDOW),
            "note": "min_duration_s and warmup_s are for answers of up to 256 tokens; each mix's own are under mixes",
        },
        "step_model": {key: value for key, value in model.describe().items() if key != "source"},
        **result,
        "validation": {
            "one_replica_vs_open_loop": validate_against_open_loop(config, REPO_ROOT / open_loop, seed),
            "step_model_vs_server_records": validate_step_model(
                model, [REPO_ROOT / open_loop, REPO_ROOT / "benchmarks/reference/cpu/ch08.json"],
                mean_decode_context(MIXES["default"], seed)),
        },
        "environment": environment(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"{len(result['points'])} points in {time.perf_counter() - started:.1f} s -> {out}")
    return document


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--step-times", type=Path, default=DEFAULT_STEP_TIMES)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--routers", nargs="+", choices=sorted(ROUTER_FACTORIES), default=list(ROUTERS))
    args = parser.parse_args(argv)
    run(args.step_times, args.out, seed=args.seed, workers=args.workers, routers=args.routers)


if __name__ == "__main__":
    main()
