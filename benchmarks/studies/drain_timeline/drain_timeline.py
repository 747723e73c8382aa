"""Record chapter 7's drain around a SIGTERM: requests in flight, readiness and refusals over time.

Starts a real chapter 7 server (``python -m chapters.ch07_production --port N``, loopback), runs a
closed-loop load of ``--clients`` clients for ``--load-before-s`` seconds, sends SIGTERM, and keeps
the clients going until the server has exited. Meanwhile it polls ``/readyz`` (ready or not) and
``/stats`` (``in_flight``: the requests the drain is waiting for) every ``--poll-interval-s``.
Every request's start, end and outcome is recorded: an HTTP status, ``no connection`` once the
server has closed its socket, or ``error``. A client answered 503 pauses ``--retry-pause-s`` before
its next request (a well-behaved client honours ``Retry-After``; the pause is shorter so the
timeline shows the refusals). Times are in seconds from the SIGTERM.

    python -m benchmarks.studies.drain_timeline.drain_timeline --out benchmarks/reference/cpu/ch07/drain-timeline.json

The result is what ``notebooks/ch07_production.ipynb`` plots (``$SFS_RESULTS_DIR/ch07/drain-timeline.json``).
Bounded: the server gets ``--drain-timeout-s`` plus a margin to exit, then SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.harness.server_process import running_module
from benchmarks.harness.workload import PROMPT_ID_RANGE, PROMPT_LENGTHS

MODULE = "chapters.ch07_production"
NO_CONNECTION = "no connection"
KIND = "ch07-drain-timeline"
SCHEMA = 1
EXIT_MARGIN_S = 15.0  # beyond the drain timeout: uvicorn's own shutdown, then SIGKILL


@dataclass
class RequestSpan:
    start_s: float
    end_s: float
    status: int | str  # HTTP status, NO_CONNECTION or "error"


@dataclass
class Poll:
    t_s: float
    readyz_status: int | None  # None: nothing answered
    ready: bool | None
    reason: str | None
    in_flight: int | None


@dataclass
class Timeline:
    """Everything the notebook plots; every time in seconds from the SIGTERM."""

    kind: str
    schema: int
    started_at: str
    command: str
    server_command: list[str]
    clients: int
    max_new_tokens: int
    load_before_s: float
    poll_interval_s: float
    drain_timeout_s: float
    retry_pause_s: float
    python: str
    platform: str
    exit_s: float | None = None
    exit_code: int | None = None
    drain_log: list[dict] = field(default_factory=list)  # {"t_s", "message"}: the server's own account
    requests: list[RequestSpan] = field(default_factory=list)
    polls: list[Poll] = field(default_factory=list)


async def _wait_ready(url: str, process, timeout_s: float) -> None:
    """Until ``/readyz`` says 200 (the first readiness probe has passed); polling: no event to await."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"/readyz did not answer 200 within {timeout_s} s")


async def record_drain(url: str, process, *, clients: int, max_new_tokens: int, load_before_s: float,
                       poll_interval_s: float, drain_timeout_s: float, retry_pause_s: float,
                       seed: int = 1234) -> tuple[list[RequestSpan], list[Poll], float | None, float]:
    """Load, SIGTERM ``process`` after ``load_before_s``, record until it exits (bounded).

    Returns the requests, the polls, the exit time (s from the SIGTERM; None if it had to be killed)
    and the wall-clock time of the SIGTERM."""
    clock = time.perf_counter
    sigterm_at: list[float] = []  # set once; times are rebased on it at the end
    sigterm_wall: list[float] = []
    exited = asyncio.Event()
    spans: list[tuple[float, float, int | str]] = []
    polls: list[tuple[float, int | None, bool | None, str | None, int | None]] = []

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1_000_003 + index)
        async with httpx.AsyncClient(base_url=url, timeout=drain_timeout_s + EXIT_MARGIN_S) as client:
            while not exited.is_set():
                length = rng.choice(PROMPT_LENGTHS)
                body = {"input_ids": [rng.randrange(PROMPT_ID_RANGE) for _ in range(length)],
                        "max_new_tokens": max_new_tokens}
                start = clock()
                status: int | str
                try:
                    status = (await client.post("/v1/inference", json=body)).status_code
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    status = NO_CONNECTION if sigterm_at else "error"
                except httpx.HTTPError:
                    status = "error"
                spans.append((start, clock(), status))
                if status == NO_CONNECTION:
                    return  # the server is gone: a real client would now go to another instance
                if status == 503:
                    try:
                        await asyncio.wait_for(exited.wait(), retry_pause_s)
                    except TimeoutError:
                        pass

    async def poller() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=max(1.0, 10 * poll_interval_s)) as client:
            next_tick = clock()
            while not exited.is_set():
                at = clock()
                readyz_status = ready = reason = in_flight = None
                try:
                    answer = await client.get("/readyz")
                    readyz_status, body = answer.status_code, answer.json()
                    ready, reason = body.get("ready"), body.get("reason")
                    in_flight = (await client.get("/stats")).json().get("in_flight")
                except (httpx.HTTPError, ValueError):
                    pass
                polls.append((at, readyz_status, ready, reason, in_flight))
                next_tick += poll_interval_s
                try:
                    await asyncio.wait_for(exited.wait(), max(0.0, next_tick - clock()))
                except TimeoutError:
                    pass

    async def conductor() -> float | None:
        await asyncio.sleep(load_before_s)  # the steady state before the signal, for comparison
        sigterm_at.append(clock())
        sigterm_wall.append(time.time())
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, drain_timeout_s + EXIT_MARGIN_S)
            exit_at: float | None = clock()
        except subprocess.TimeoutExpired:  # the drain overran every bound
            process.kill()
            await asyncio.to_thread(process.wait)
            exit_at = None
        exited.set()
        return exit_at

    tasks = [asyncio.create_task(client_loop(i)) for i in range(clients)]
    polling = asyncio.create_task(poller())
    exit_at = await conductor()
    await asyncio.gather(*tasks, polling)
    zero = sigterm_at[0]
    return ([RequestSpan(round(s - zero, 4), round(e - zero, 4), status) for s, e, status in spans],
            [Poll(round(t - zero, 4), code, ready, reason, n) for t, code, ready, reason, n in polls],
            None if exit_at is None else round(exit_at - zero, 4), sigterm_wall[0])


SHUTDOWN_LINES = re.compile(r"drain|SIGTERM|cut off|Shutting down|shutdown complete|Finished server process")


def _drain_log(log_text: str, sigterm_wall: float) -> list[dict]:
    """The server's JSON log lines about the signal, the drain and the shutdown, timed from the SIGTERM
    (``sigterm_wall``: the recorder's wall clock when it sent the signal; the log's clock has ms)."""
    lines = []
    for line in log_text.splitlines():
        try:
            entry = json.loads(line)
            message = entry["message"]
            at = datetime.strptime(entry["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except (ValueError, KeyError, TypeError):
            continue  # not one of the server's JSON lines
        if SHUTDOWN_LINES.search(message):
            lines.append({"t_s": round(at - sigterm_wall, 3), "message": message})
    return lines


def run(args: argparse.Namespace, argv: list[str]) -> Timeline:
    server_args = ["--drain-timeout-s", f"{args.drain_timeout_s:g}", *args.server_args.split()]
    with running_module(MODULE, server_args, name="ch07") as server:
        asyncio.run(_wait_ready(server.url, server.process, args.ready_timeout_s))
        requests, polls, exit_s, sigterm_wall = asyncio.run(record_drain(
            server.url, server.process, clients=args.clients, max_new_tokens=args.max_new_tokens,
            load_before_s=args.load_before_s, poll_interval_s=args.poll_interval_s,
            drain_timeout_s=args.drain_timeout_s, retry_pause_s=args.retry_pause_s, seed=args.seed))
        exit_code = server.process.returncode
        log_text = server.log_path.read_text(errors="replace")
        command = server.command
    return Timeline(
        kind=KIND, schema=SCHEMA, started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        command=" ".join(["python -m benchmarks.studies.drain_timeline.drain_timeline", *argv]), server_command=command,
        clients=args.clients, max_new_tokens=args.max_new_tokens, load_before_s=args.load_before_s,
        poll_interval_s=args.poll_interval_s, drain_timeout_s=args.drain_timeout_s, retry_pause_s=args.retry_pause_s,
        python=platform.python_version(), platform=platform.platform(), exit_s=exit_s, exit_code=exit_code,
        drain_log=_drain_log(log_text, sigterm_wall), requests=requests, polls=polls,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.drain_timeline.drain_timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients (requests in flight)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--load-before-s", type=float, default=3.0, help="load before the SIGTERM")
    parser.add_argument("--poll-interval-s", type=float, default=0.05)
    parser.add_argument("--drain-timeout-s", type=float, default=20.0, help="the server's --drain-timeout-s")
    parser.add_argument("--retry-pause-s", type=float, default=0.2, help="a client's pause after a 503")
    parser.add_argument("--ready-timeout-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--server-args", default="--engine eager --precision fp32 --fallback-slots 0",
                        help="extra flags for the server (default: a fast start)")
    args = parser.parse_args(argv)
    for name in ("clients", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("load_before_s", "poll_interval_s", "retry_pause_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    timeline = run(args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(timeline), indent=1) + "\n")
    refused = sum(1 for r in timeline.requests if r.status == 503 or r.status == NO_CONNECTION)
    print(f"{len(timeline.requests)} requests ({refused} refused), {len(timeline.polls)} polls, "
          f"exit {timeline.exit_code} at {timeline.exit_s} s after SIGTERM -> {args.out}")
    return 0 if timeline.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
