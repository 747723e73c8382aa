"""What watching costs: a chapter's throughput under load with the live page's event stream open and without.

The live page (``/ui/``) must stay off the hot path. This measures it the way the streaming
comparison measures servers (``benchmarks/harness/streaming.py``: a closed loop of ``--users`` clients, the
climb's ``cpu`` profile, server and client on their own cores), on ONE server per round, twice:
``unwatched``, then ``watched`` with ``--viewers`` subscribers reading ``/ui/events`` for the whole
run (each reads every byte and counts the events), or the other way round every other round. The
viewers run in the client's process, on the client's core: what is measured is what the stream
costs the SERVER (building, serializing and sending its events), not a browser's drawing. Each round
keeps both runs of the same server side by side; the file has every round and the median ratios of
throughput and of the server's CPU time per answered request (user + system, all its threads: the
figure a noisy neighbour disturbs least).

    python -m benchmarks.studies.live_page_cost.live_page_cost --profile cpu --chapter ch08 --users 64 --duration-s 20 --rounds 3 \\
        --out benchmarks/reference/cpu/ch08/live-page-cost.json
    python -m benchmarks.studies.live_page_cost.live_page_cost --profile cpu --chapter ch03 --users 64 --duration-s 20 --rounds 3 \\
        --out benchmarks/reference/cpu/ch03/live-page-cost.json

On a shared machine two runs of the same server differ by more than the stream can cost, so
``--in-process`` also measures chapter 8's part directly, side by side and without HTTP: the server's
own backend (defaults, one torch thread) with ``--sequences`` decoding, alternating one step and one
event built and serialized as the step thread and the loop do it, each timed in CPU time. The file
has the medians, their ratio (what one event per step costs) and the share of the server's time that
leaves at the cap of ``MAX_EVENTS_PER_S`` events a second:

    python -m benchmarks.studies.live_page_cost.live_page_cost --in-process --sequences 64 \\
        --out benchmarks/reference/cpu/ch08/live-page-event-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.harness.results import print_and_save
from benchmarks.harness.streaming import WORKLOADS, harness_settings, run_closed_loop, summarize

LIVE_CHAPTERS = ("ch03", "ch04", "ch05", "ch06", "ch07", "ch08")
EVENT_NAME = re.compile(rb"^event: (\w+)$", re.MULTILINE)
DROPPED_TOTAL = re.compile(rb'"dropped_total":\s*(\d+)')


class ViewerCount:
    """What one subscriber saw: events by kind, and the drops the server reported to it."""

    def __init__(self) -> None:
        self.events: dict[str, int] = {}
        self.bytes = 0
        self.dropped_total = 0


async def watch(url: str, seen: ViewerCount, stop: asyncio.Event) -> None:
    """Read ``/ui/events`` until ``stop`` is set, counting events by kind from the raw bytes.

    Regular expressions over whole chunks, not a JSON parse per event: the viewer shares the client's
    core with the load generator, and its own work must not be what slows the measured load down.
    """
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async with client.stream("GET", "/ui/events") as response:
            response.raise_for_status()
            chunks = response.aiter_raw()
            tail = b""
            while not stop.is_set():
                reading = asyncio.ensure_future(anext(chunks))
                stopping = asyncio.ensure_future(stop.wait())
                done, _ = await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if reading not in done:
                    reading.cancel()
                    break
                stopping.cancel()
                chunk = reading.result()
                seen.bytes += len(chunk)
                text = tail + chunk
                cut = text.rfind(b"\n\n") + 2  # count whole events only; the rest waits for the next chunk
                for kind in EVENT_NAME.findall(text, 0, cut):
                    seen.events[kind.decode()] = seen.events.get(kind.decode(), 0) + 1
                for total in DROPPED_TOTAL.findall(text, 0, cut):
                    seen.dropped_total = int(total)
                tail = text[cut:]


async def measure(url: str, server_pid: int, users: int, duration_s: float, workload: str, stream: bool, viewers: int,
                  seed: int) -> dict[str, Any]:
    """One closed-loop run with ``viewers`` subscribers; plus the server's CPU time per answered request."""
    server = psutil.Process(server_pid)
    cpu_before = sum(server.cpu_times()[:2])
    stop = asyncio.Event()
    seen = [ViewerCount() for _ in range(viewers)]
    watchers = [asyncio.create_task(watch(url, count, stop)) for count in seen]
    try:
        records, window = await run_closed_loop(url, users, duration_s, workload, stream, seed=seed)
    finally:
        stop.set()
        await asyncio.gather(*watchers, return_exceptions=True)
    cpu_s = sum(server.cpu_times()[:2]) - cpu_before
    result = summarize(records, window, None, None, None)
    result["server_cpu_s"] = cpu_s
    result["server_cpu_ms_per_request"] = 1e3 * cpu_s / result["completed"] if result["completed"] else None
    if viewers:
        result["viewers"] = [{"events": count.events, "bytes": count.bytes, "dropped_total": count.dropped_total} for count in seen]
    return result


def in_process(sequences: int, samples: int, seed: int) -> dict[str, Any]:
    """Chapter 8's step and its live-page event, alternately, timed in this thread's CPU time."""
    import random
    import time

    from benchmarks.harness.workload import PROMPT_LENGTHS
    from chapters.ch08_continuous_batching.live_steps import MAX_EVENTS_PER_S
    from chapters.ch08_continuous_batching.scheduler import Sequence
    from chapters.ch08_continuous_batching.server import ContinuousSettings, build_backend
    from shared.devices import choose_device, set_threads
    from shared.weights import load_model

    settings = ContinuousSettings(weights="default", device="cpu", torch_threads=1)
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    thread = build_backend(settings, loaded).step_thread
    scheduler, rng = thread.scheduler, random.Random(seed)
    for _ in range(sequences):  # prompts of the default workload's lengths, answers long enough to outlast the run
        prompt = [rng.randrange(1, 250) for _ in range(rng.choice(PROMPT_LENGTHS))]
        scheduler.add(Sequence(prompt, loaded.config.n_ctx - len(prompt)))
    while scheduler.waiting or any(s.num_computed < len(s.prompt_ids) for s in scheduler.running):
        thread.step()
    step_ms, event_ms, sizes = [], [], []
    for _ in range(samples):
        started = time.thread_time()
        thread.step()
        step_ms.append((time.thread_time() - started) * 1e3)
        record = thread.clock.recent[-1]
        started = time.thread_time()
        event = thread.view.step_event(None, {"model": record.model_ms}, {}, last=True)
        sizes.append(len(json.dumps(event, separators=(",", ":"))))
        event_ms.append((time.thread_time() - started) * 1e3)
    step, cost = statistics.median(step_ms), statistics.median(event_ms)
    events_per_step = min(1.0, MAX_EVENTS_PER_S * step / 1e3)  # the cap, when steps come faster than it
    return {"kind": "live-page-event-cost", "schema": 1, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "sequences": sequences, "running": len(scheduler.running), "samples": samples,
            "blocks_total": scheduler.manager.total_blocks, "cached_blocks": scheduler.manager.cached_blocks,
            "median_step_cpu_ms": step, "median_event_cpu_ms": cost, "median_event_bytes": statistics.median(sizes),
            "event_per_step_ratio": cost / step, "max_events_per_s": MAX_EVENTS_PER_S, "events_per_step_at_cap": events_per_step,
            "cost_share_at_cap": cost * events_per_step / (step + cost * events_per_step)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.live_page_cost.live_page_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapter", choices=LIVE_CHAPTERS, default="ch08", help="a chapter with the live page")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    parser.add_argument("--viewers", type=int, default=1, help="open pages in the watched runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--server-args", default="", help="extra flags for the server")
    parser.add_argument("--profile", choices=("cpu",), default=None, help="run the server as the climb's profile does")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--in-process", action="store_true", help="chapter 8's step and event side by side, no HTTP")
    parser.add_argument("--sequences", type=int, default=64, help="--in-process: sequences decoding")
    parser.add_argument("--samples", type=int, default=200, help="--in-process: steps (and events) timed")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.in_process:
        print_and_save({**in_process(args.sequences, args.samples, args.seed),
                        "command": "python -m benchmarks.studies.live_page_cost.live_page_cost " + shlex.join(argv)}, args.out)
        return
    if args.users < 1 or args.rounds < 1 or args.viewers < 1 or args.duration_s <= 0:
        parser.error("--users, --rounds and --viewers must be at least 1 and --duration-s positive")

    from benchmarks.harness.server_process import running_server

    harness, profile_args, server_env = harness_settings(args.profile)
    stream = args.chapter == "ch08"  # chapters 3-7 answer whole responses
    rounds = []
    for index in range(args.rounds):
        order = ["unwatched", "watched"] if index % 2 == 0 else ["watched", "unwatched"]
        with running_server(args.chapter, [*profile_args, *args.server_args.split()], env=server_env,
                            cpu_cores=harness["server_cores"]) as server:
            # A short unmeasured warm-up: first allocations, lazy kernels.
            asyncio.run(run_closed_loop(server.url, min(args.users, 4), 2.0, args.workload, stream, seed=args.seed + 1))
            row: dict[str, Any] = {"order": order}
            for label in order:
                row[label] = asyncio.run(measure(server.url, server.pid, args.users, args.duration_s, args.workload, stream,
                                                 args.viewers if label == "watched" else 0, args.seed + index))
            row["ratio"] = row["watched"]["qps"] / row["unwatched"]["qps"]
            row["cpu_per_request_ratio"] = row["watched"]["server_cpu_ms_per_request"] / row["unwatched"]["server_cpu_ms_per_request"]
            rounds.append(row)
            print(f"round {index + 1}: {order[0]} first: unwatched {row['unwatched']['qps']:.1f} req/s, "
                  f"watched {row['watched']['qps']:.1f} req/s, ratio {row['ratio']:.3f}, "
                  f"server CPU per request ratio {row['cpu_per_request_ratio']:.3f}", file=sys.stderr)
    result = {"kind": "live-page-cost", "schema": 1, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": "python -m benchmarks.studies.live_page_cost.live_page_cost " + shlex.join(argv), "chapter": args.chapter,
              "workload": args.workload, "users": args.users, "duration_s": args.duration_s, "viewers": args.viewers,
              "streamed": stream, "harness": harness, "rounds": rounds,
              "median_ratio": statistics.median(row["ratio"] for row in rounds),
              "median_cpu_per_request_ratio": statistics.median(row["cpu_per_request_ratio"] for row in rounds)}
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
