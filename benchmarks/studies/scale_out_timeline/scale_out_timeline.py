"""Chapter 9 under load, over time: the failure drill and the autoscaling step.

Both start chapter 9 in this process, as ``python -m chapters.ch09_scale_out`` does (a loopback Ray
cluster, Serve's proxy with the contract at its edge, replicas of chapter 8's server), drive it
with closed-loop clients (every other request of each a stream) and, every ``--poll-interval-s``,
record Serve's count of running replicas and the replica processes alive. Every request's start,
end and outcome is kept (:func:`outcome_of_whole`, :func:`outcome_of_stream`):

- ``ok``: the whole answer (a stream: its ``done`` event);
- ``replayed``: the whole answer, after the edge sent it to another replica (``X-Attempts: 2``);
- ``contract_error``: the contract's JSON error, or a stream that ends with its error event;
- ``broken``: anything else: a plain-text error, a stream cut without an error event, a dropped
  connection. Neither scenario expects any.

``drill``: ``--clients`` clients for ``--load-before-s``, then SIGKILL one replica's process (Ray
titles it ``ray::ServeReplica:ch09:...``), load for ``--load-after-s`` more. Times are from the
kill. :func:`account` is the ledger: nothing lost, only requests in flight at the kill touched,
``capacity_back_s``, when Serve counted ``--num-replicas`` running replicas again (with
``--spare-replicas``, the survivors already make that count), when every replica ran again, and
the answers per second just before and after the kill.

``autoscale``: ``--min-replicas`` to ``--max-replicas`` with short delays; the clients follow
``--steps`` (``seconds:clients`` each), e.g. a quiet start, a step up, a step down. Times are from
the start of the load.

    python -m benchmarks.studies.scale_out_timeline.scale_out_timeline drill --out benchmarks/reference/cpu/ch09/failure-drill.json
    python -m benchmarks.studies.scale_out_timeline.scale_out_timeline autoscale --out benchmarks/reference/cpu/ch09/autoscale-timeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import chapters.ch09_scale_out  # noqa: F401  (before Ray: loopback and the edge, see its __init__)
import httpx
import psutil

from benchmarks.harness.server_process import free_port
from benchmarks.harness.workload import PROMPT_ID_RANGE, PROMPT_LENGTHS

KINDS = {"drill": "ch09-failure-drill", "autoscale": "ch09-autoscale-timeline"}
SCHEMA = 1
# A replica's start-up is how long capacity stays short after a loss or a scale-up. The chapter's
# defaults measure the engine and the attention backend in every replica at start and compile flex
# attention; these pin what those rules choose on a CPU, except that gather needs no compiling.
FAST_START = "--torch-threads 1 --drain-timeout-s 10 --engine eager --precision bf16 --attention gather"
OUTCOMES = ("ok", "replayed", "contract_error", "broken")
REPLICA_PROCESS = "ServeReplica:"  # in the title Ray gives a replica's process


@dataclass
class RequestSpan:
    start_s: float
    end_s: float
    stream: bool
    status: int | None  # None: no HTTP answer at all
    outcome: str  # one of OUTCOMES
    detail: str = ""  # the error's type, or what was broken


@dataclass
class Poll:
    t_s: float
    running: int | None  # Serve's count of RUNNING replicas (None: the controller did not answer)
    replica_pids: list[int]


@dataclass
class Timeline:
    """Everything the notebook plots and the README quotes; times in seconds from the kill (drill)
    or from the start of the load (autoscale)."""

    kind: str
    schema: int
    started_at: str
    command: str
    server_args: list[str]
    steps: list[tuple[float, int]]  # (seconds, clients) in order: the load's shape
    max_new_tokens: int
    poll_interval_s: float
    python: str
    platform: str
    cpu_count: int | None
    killed_pid: int | None = None
    killed_at_s: float | None = None
    # replicas that started during the load: pid -> {"process_started_s", "log": [{"t_s", "message"}]}, the
    # replica's own log lines (chapter 7's JSON) timed like everything else: where its start-up went
    replica_startups: dict[str, dict] = field(default_factory=dict)
    requests: list[RequestSpan] = field(default_factory=list)
    polls: list[Poll] = field(default_factory=list)
    accounting: dict = field(default_factory=dict)


def outcome_of_whole(status: int, headers: httpx.Headers, body: bytes) -> tuple[str, str]:
    """The outcome of a non-streaming answer: (outcome, detail)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return "broken", f"{status}, not JSON: {body[:60]!r}"
    if status == 200 and isinstance(payload, dict) and "output_ids" in payload:
        return ("replayed" if headers.get("x-attempts") else "ok"), ""
    error = payload.get("error") if isinstance(payload, dict) else None
    if status >= 400 and isinstance(error, dict) and error.get("type") and "message" in error:
        return "contract_error", error["type"]
    return "broken", f"{status}: {body[:60]!r}"


def outcome_of_stream(status: int, headers: httpx.Headers, lines: list[str]) -> tuple[str, str]:
    """The outcome of a ``/v1/inference`` stream from its lines: it must end in ``done`` or ``error``."""
    if status != 200:
        return outcome_of_whole(status, headers, "\n".join(lines).encode())
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    if events and events[-1] == "done":
        return ("replayed" if headers.get("x-attempts") else "ok"), ""
    if events and events[-1] == "error":
        try:
            return "contract_error", json.loads(data[-1])["error"]["type"]
        except (ValueError, KeyError, TypeError, IndexError):
            return "broken", "an error event without the contract's body"
    return "broken", f"the stream stopped after {len(events)} events without done or error"


def account(requests: list[RequestSpan], polls: list[Poll], num_replicas: int, spare_replicas: int = 0,
            window_s: float = 5.0) -> dict:
    """The drill's ledger (times from the kill at 0 s).

    ``touched``: requests that were replayed or failed; each must have been in flight at the kill
    (``touched_outside_kill`` counts those that were not). ``capacity_back_s``: the first poll after
    the kill with the ``num_replicas`` the load needs running, none of them the killed process (None:
    never); with warm spares that is as soon as Serve counts the survivors. ``replacement_ready_s``:
    the first with every replica, spares included, running again. ``answers_per_s_before``/``_after``:
    answers completed (ok or replayed, streams included) per second in the ``window_s`` before and after the kill.
    """
    capacity_back_s = _first_poll_with(polls, num_replicas)
    answered = [r.end_s for r in requests if r.outcome in ("ok", "replayed")]
    by_outcome = {name: sum(1 for r in requests if r.outcome == name) for name in OUTCOMES}
    in_flight_at_kill = [r for r in requests if r.start_s <= 0 <= r.end_s]
    touched = [r for r in requests if r.outcome in ("replayed", "contract_error", "broken")]
    return {
        "requests": len(requests),
        **by_outcome,
        "in_flight_at_kill": len(in_flight_at_kill),
        "touched": len(touched),
        "touched_outside_kill": sum(1 for r in touched if not r.start_s <= 0 <= r.end_s),
        "contract_error_types": sorted({r.detail for r in requests if r.outcome == "contract_error"}),
        "capacity_back_s": capacity_back_s,
        "spare_replicas": spare_replicas,
        "replacement_ready_s": _first_poll_with(polls, num_replicas + spare_replicas) if spare_replicas else capacity_back_s,
        "answers_per_s_before": round(sum(1 for t in answered if -window_s <= t < 0) / window_s, 2),
        "answers_per_s_after": round(sum(1 for t in answered if 0 <= t < window_s) / window_s, 2),
    }


def _first_poll_with(polls: list[Poll], replicas: int) -> float | None:
    """The first poll after the kill with ``replicas`` running by Serve's count and as live processes, not the killed one."""
    before = [p for p in polls if p.t_s < 0]
    killed_pids = set(before[-1].replica_pids) if before else set()
    for poll in polls:
        if poll.t_s >= 0 and poll.running is not None and poll.running >= replicas \
                and len(set(poll.replica_pids)) >= replicas and set(poll.replica_pids) != killed_pids:
            return poll.t_s
    return None


def replica_processes() -> list[psutil.Process]:
    """This process's descendants that are Serve replicas (Ray titles them ``ray::ServeReplica:...``)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(REPLICA_PROCESS in part for part in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.pid)


def ray_logs_dir() -> str:
    """Where this process's Ray session keeps its processes' logs (Ray has no public call for it)."""
    import ray

    return ray._private.worker._global_node.get_logs_dir_path()


def replica_log(logs_dir: Path, pid: int, zero_wall: float) -> list[dict]:
    """A replica's own JSON log lines (chapter 7's format, from its process's stderr file), timed from ``zero_wall``."""
    lines = []
    for path in logs_dir.glob(f"worker-*-{pid}.err"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line[line.index("{"):])
                at = datetime.strptime(entry["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except (ValueError, KeyError, TypeError):
                continue  # Ray's own lines, not the chapter's
            lines.append({"t_s": round(at - zero_wall, 3), "message": str(entry.get("message", ""))[:200]})
    return lines


def running_replicas(app_name: str) -> int | None:
    from ray import serve

    try:
        application = serve.status().applications[app_name]
    except Exception:  # the controller busy or restarting: a gap in the timeline, not the end of the drill
        return None
    return sum(count for deployment in application.deployments.values()
               for state, count in deployment.replica_states.items() if str(state).endswith("RUNNING"))


async def drive(url: str, app_name: str, *, steps: list[tuple[float, int]], kill_after_s: float | None,
                max_new_tokens: int, poll_interval_s: float, request_timeout_s: float,
                seed: int) -> tuple[list[RequestSpan], list[Poll], int | None, float | None, dict[int, float], float]:
    """Run the load's ``steps`` (seconds, clients), kill a replica ``kill_after_s`` into it if asked.

    Returns the spans and polls (times from the start of the load), the killed pid, when it died, and
    when each replica process that started during the load did, and the load's start (wall clock)."""
    clock = time.perf_counter
    stop = asyncio.Event()
    clients_now = [0]
    changed = asyncio.Condition()
    raw_spans: list[tuple] = []
    raw_polls: list[tuple] = []
    process_started: dict[int, float] = {}  # pid -> wall-clock start, for every replica process seen

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1_000_003 + index)
        stream = index % 2 == 0
        async with httpx.AsyncClient(base_url=url, timeout=request_timeout_s) as client:
            while not stop.is_set():
                if index >= clients_now[0]:  # not in this step of the load: wait for the next step
                    async with changed:
                        await changed.wait()
                    continue
                length = rng.choice(PROMPT_LENGTHS)
                body = {"input_ids": [rng.randrange(PROMPT_ID_RANGE) for _ in range(length)],
                        "max_new_tokens": max_new_tokens, "stream": stream}
                start, status = clock(), None
                try:
                    if stream:
                        async with client.stream("POST", "/v1/inference", json=body) as response:
                            status = response.status_code
                            lines = [line async for line in response.aiter_lines() if line]
                        outcome, detail = outcome_of_stream(status, response.headers, lines)
                    else:
                        response = await client.post("/v1/inference", json=body)
                        status = response.status_code
                        outcome, detail = outcome_of_whole(status, response.headers, response.content)
                except httpx.HTTPError as exc:
                    outcome, detail = "broken", type(exc).__name__
                raw_spans.append((start, clock(), stream, status, outcome, detail))
                stream = not stream
                if outcome != "ok" and outcome != "replayed":
                    await asyncio.sleep(0.2)  # a client backs off after an error (Retry-After is 1 s; shorter shows more)

    async def poller() -> None:
        while not stop.is_set():
            at = clock()
            running = await asyncio.to_thread(running_replicas, app_name)
            replicas = replica_processes()
            for process in replicas:
                if process.pid not in process_started:
                    try:
                        process_started[process.pid] = process.create_time()
                    except psutil.Error:
                        pass
            raw_polls.append((at, running, [p.pid for p in replicas]))
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, poll_interval_s - (clock() - at)))
            except TimeoutError:
                pass

    async def killer(zero: float) -> tuple[int, float]:
        await asyncio.sleep(kill_after_s)
        victim = replica_processes()[0]
        killed_at = clock()
        victim.kill()
        return victim.pid, killed_at - zero

    most = max(clients for _, clients in steps)
    tasks = [asyncio.create_task(client_loop(i)) for i in range(most)]
    polling = asyncio.create_task(poller())
    zero, zero_wall = clock(), time.time()
    killing = asyncio.create_task(killer(zero)) if kill_after_s is not None else None
    for seconds, clients in steps:
        async with changed:
            clients_now[0] = clients
            changed.notify_all()
        await asyncio.sleep(seconds)
    stop.set()
    async with changed:
        changed.notify_all()
    await asyncio.gather(*tasks, polling)
    killed_pid, killed_at_s = await killing if killing is not None else (None, None)
    spans = [RequestSpan(round(s - zero, 4), round(e - zero, 4), stream, status, outcome, detail)
             for s, e, stream, status, outcome, detail in raw_spans]
    polls = [Poll(round(t - zero, 4), running, pids) for t, running, pids in raw_polls]
    started = {pid: round(wall - zero_wall, 3) for pid, wall in process_started.items() if wall > zero_wall}
    return spans, polls, killed_pid, killed_at_s, started, zero_wall


def run(scenario: str, args: argparse.Namespace, argv: list[str]) -> Timeline:
    from ray import serve

    from chapters.ch09_scale_out.cluster import LOOPBACK, local_cluster
    from chapters.ch09_scale_out.server import APP_NAME, ScaleOutSettings, build_application
    from shared.settings import parse_settings

    if scenario == "drill":
        replicas = ["--num-replicas", str(args.num_replicas), "--spare-replicas", str(args.spare_replicas)]
        steps = [(args.load_before_s + args.load_after_s, args.clients)]
        kill_after_s = args.load_before_s
    else:
        replicas = ["--num-replicas", str(args.min_replicas), "--spare-replicas", "0", "--max-replicas", str(args.max_replicas),
                    "--target-ongoing-requests", str(args.target_ongoing_requests),
                    "--upscale-delay-s", f"{args.upscale_delay_s:g}", "--downscale-delay-s", f"{args.downscale_delay_s:g}",
                    "--autoscale-look-back-s", f"{args.look_back_s:g}"]
        steps, kill_after_s = args.steps, None
    server_args = [*replicas, "--replica-cpus", f"{args.replica_cpus:g}", *args.server_args.split()]
    settings = parse_settings(ScaleOutSettings, server_args, prog=f"scale_out_timeline {scenario} --server-args")
    port = free_port()
    timeline = Timeline(
        kind=KINDS[scenario], schema=SCHEMA, started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        command="python -m benchmarks.studies.scale_out_timeline.scale_out_timeline " + shlex.join(argv), server_args=server_args, steps=steps,
        max_new_tokens=args.max_new_tokens, poll_interval_s=args.poll_interval_s,
        python=platform.python_version(), platform=platform.platform(), cpu_count=psutil.cpu_count(),
    )
    with local_cluster(LOOPBACK, port, log_to_driver=False):  # the replicas' logs stay in their files (replica_log)
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)  # returns once every replica is up
        logs_dir = Path(ray_logs_dir())
        spans, polls, killed_pid, killed_at_s, started, load_started_wall = asyncio.run(drive(
            f"http://{LOOPBACK}:{port}", APP_NAME, steps=steps, kill_after_s=kill_after_s,
            max_new_tokens=args.max_new_tokens, poll_interval_s=args.poll_interval_s,
            request_timeout_s=args.request_timeout_s, seed=args.seed))
    shift = killed_at_s or 0.0
    timeline.replica_startups = {
        str(pid): {"process_started_s": round(at - shift, 3),
                   "log": replica_log(logs_dir, pid, load_started_wall + shift)}
        for pid, at in started.items()}
    if killed_at_s is not None:  # the drill's clock starts at the kill
        spans = [RequestSpan(round(r.start_s - killed_at_s, 4), round(r.end_s - killed_at_s, 4), r.stream, r.status, r.outcome, r.detail)
                 for r in spans]
        polls = [Poll(round(p.t_s - killed_at_s, 4), p.running, p.replica_pids) for p in polls]
    timeline.killed_pid, timeline.killed_at_s = killed_pid, killed_at_s
    timeline.requests, timeline.polls = spans, polls
    timeline.accounting = account(spans, polls, args.num_replicas, args.spare_replicas) if scenario == "drill" else summarize_load(spans)
    return timeline


def summarize_load(requests: list[RequestSpan]) -> dict:
    """The outcomes of a load without a kill (every one is expected ``ok``)."""
    return {"requests": len(requests), **{name: sum(1 for r in requests if r.outcome == name) for name in OUTCOMES}}


def parse_steps(text: str) -> list[tuple[float, int]]:
    """``20:2,40:16,40:2`` -> [(20.0, 2), (40.0, 16), (40.0, 2)]: seconds and clients, in order."""
    steps = []
    for part in text.split(","):
        seconds, _, clients = part.partition(":")
        try:
            step = (float(seconds), int(clients))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not seconds:clients") from None
        if step[0] <= 0 or step[1] < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: seconds must be positive, clients not negative")
        steps.append(step)
    return steps


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.scale_out_timeline.scale_out_timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    scenarios = parser.add_subparsers(dest="scenario", required=True)
    drill = scenarios.add_parser("drill", help="kill one replica under load")
    drill.add_argument("--num-replicas", type=int, default=2)
    drill.add_argument("--spare-replicas", type=int, default=0, help="warm spares beyond --num-replicas (chapter 9's --spare-replicas, passed always: 0 here shows a kill without one)")
    drill.add_argument("--clients", type=int, default=8, help="closed-loop clients; every other request of each is a stream")
    drill.add_argument("--load-before-s", type=float, default=5.0, help="load before the kill")
    drill.add_argument("--load-after-s", type=float, default=40.0, help="load after the kill")
    autoscale = scenarios.add_parser("autoscale", help="a step load against an autoscaling deployment")
    autoscale.add_argument("--min-replicas", type=int, default=1)
    autoscale.add_argument("--max-replicas", type=int, default=3)
    autoscale.add_argument("--steps", type=parse_steps, default=parse_steps("20:2,60:24,60:2"),
                           help="the load: seconds:clients, comma-separated, in order")
    autoscale.add_argument("--target-ongoing-requests", type=int, default=8,
                           help="requests held per replica that autoscaling aims at (the chapter's default, a full batch, "
                                "is more than this machine's knee)")
    autoscale.add_argument("--upscale-delay-s", type=float, default=3.0, help="short, for the demo (Serve's default: 30)")
    autoscale.add_argument("--downscale-delay-s", type=float, default=10.0, help="short, for the demo (Serve's default: 600)")
    autoscale.add_argument("--look-back-s", type=float, default=2.0, help="short, for the demo (Serve's default: 30)")
    for sub in (drill, autoscale):
        sub.add_argument("--out", type=Path, required=True, help="the JSON file to write")
        sub.add_argument("--replica-cpus", type=float, default=0.5)
        sub.add_argument("--max-new-tokens", type=int, default=64)
        sub.add_argument("--poll-interval-s", type=float, default=0.25)
        sub.add_argument("--request-timeout-s", type=float, default=60.0, help="a client gives up after this (an outcome: broken)")
        sub.add_argument("--seed", type=int, default=1234)
        sub.add_argument("--server-args", default=FAST_START,
                         help="chapter 9's flags for every replica (default: a fast start, see FAST_START)")
    args = parser.parse_args(argv)
    if args.scenario == "drill" and args.num_replicas < 2:
        parser.error("--num-replicas must be at least 2: with one, the drill shows an outage, not a failover")
    if args.scenario == "autoscale" and not 1 <= args.min_replicas < args.max_replicas:
        parser.error("autoscaling needs 1 <= --min-replicas < --max-replicas")
    for name in ("max_new_tokens", "clients"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("load_before_s", "load_after_s", "poll_interval_s", "request_timeout_s", "replica_cpus"):
        if getattr(args, name, 1) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    timeline = run(args.scenario, args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(timeline), indent=1) + "\n")
    ledger = timeline.accounting
    print(json.dumps(ledger), f"-> {args.out}")
    if args.scenario == "drill":
        return 0 if ledger["broken"] == 0 and ledger["touched_outside_kill"] == 0 and ledger["capacity_back_s"] is not None else 1
    return 0 if ledger["broken"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

