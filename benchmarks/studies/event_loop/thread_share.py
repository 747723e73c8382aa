"""Where a served chapter 8's one core goes: the step thread against the event loop, per source tree.

Runs chapter 8 from each ``--tree`` (a checkout: this one, and a worktree of the commit before a
change) under the side-by-side's closed loop (``benchmarks.harness.streaming``: the climb's ``cpu`` profile,
server pinned to one core, the client on the other), round by round, the trees' order reversed every
other round, and reads each thread's CPU seconds from ``/proc/<pid>/task`` over the measured window.
The event loop is the server's main thread (uvicorn, the shell, every request's coroutine); the step
thread is chapter 8's ``step-thread``, the busiest of the others (before Python 3.14 a thread's name
stays Python's, not the OS's, so it is found by its CPU). A second of the core the event loop takes is
a second no step runs.

    git worktree add /tmp/base 6db7280~1
    python benchmarks/studies/event_loop/thread_share.py --trees /tmp/base . --labels polling waiting \
        --workload default --no-stream --out benchmarks/studies/event_loop/default-no-stream.json

``--both`` measures every tree streamed and with whole answers in the same rounds: what streaming
each token costs the server. ``--tree-args`` gives each tree flags of its own (the same tree twice,
at two settings: ``--trees /tmp/wt /tmp/wt --tree-args= --tree-args=--stream-interval=16``). Each thread's
CPU time is split as the kernel reports it: in the process's own code, and in the kernel on its
behalf (system calls: for the event loop, mostly its socket writes).

``python -m benchmarks readme`` writes chapter 8's README table from the ``.json`` files here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import benchmarks.harness.server_process as server_process  # noqa: E402
from benchmarks.harness.environment import cpu_description  # noqa: E402
from benchmarks.harness.streaming import harness_settings, run_closed_loop, summarize  # noqa: E402

MODULE = "chapters.ch08_continuous_batching"
TICKS = os.sysconf("SC_CLK_TCK")


def thread_seconds(pid: int) -> dict[str, tuple[float, float]]:
    """CPU seconds (user, system) of each thread of ``pid``: ``event loop`` (the main thread) and the rest by thread id."""
    seconds: dict[str, tuple[float, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended meanwhile
        seconds["event loop" if tid == str(pid) else tid] = (int(fields[11]) / TICKS, int(fields[12]) / TICKS)
    return seconds


def measure(tree: Path, stream: bool, args: argparse.Namespace, tree_args: tuple[str, ...] = ()) -> dict:
    harness, flags, env = harness_settings("cpu")
    flags = [*flags, *tree_args]
    # The chapter's code from ``tree`` (first on the path), the harness's client from this checkout.
    launcher = f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); runpy.run_module({MODULE!r}, run_name='__main__')"
    server_process.server_command = lambda module, port, extra=(): [sys.executable, "-c", launcher, "--port", str(port), *extra]
    with server_process.running_module(MODULE, flags, name="ch08", env=env, cpu_cores=harness["server_cores"]) as server:
        asyncio.run(run_closed_loop(server.url, 4, 2.0, args.workload, stream, seed=args.seed + 1))
        before = thread_seconds(server.pid)
        records, window = asyncio.run(run_closed_loop(server.url, args.users, args.duration_s, args.workload, stream, seed=args.seed))
        after = thread_seconds(server.pid)
    split = {key: tuple(a - b for a, b in zip(after[key], before.get(key, (0.0, 0.0)))) for key in after}
    used = {key: user + system for key, (user, system) in split.items()}
    total = sum(used.values())
    # The step thread: the busiest of the others (the OS does not know Python's thread names before 3.14).
    step = max((seconds for key, seconds in used.items() if key != "event loop"), default=0.0)
    summary = summarize(records, window, None, None, None)
    return {"qps": summary["qps"], "p99_ms": summary["e2e_ms"]["p99"], "requests": summary["requests"],
            "event_loop_share": used.get("event loop", 0.0) / total, "step_share": step / total,
            "event_loop_kernel_share": split.get("event loop", (0.0, 0.0))[1] / total,
            "event_loop_ms_per_request": used.get("event loop", 0.0) / max(summary["requests"], 1) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", type=Path, required=True)
    parser.add_argument("--labels", nargs="+", default=None, help="a name per tree, for the table (default: the trees' commits)")
    parser.add_argument("--workload", default="default")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    answers = parser.add_mutually_exclusive_group()
    answers.add_argument("--no-stream", action="store_true", help="whole answers (the climb's way) instead of server-sent events")
    answers.add_argument("--both", action="store_true", help="every tree streamed and whole, in the same rounds (what streaming costs)")
    parser.add_argument("--tree-args", action="append", default=None,
                        help="server flags of one tree, once per tree in order, written --tree-args=FLAGS (default: none)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    commits = [subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
               for tree in trees]
    labels = args.labels or commits
    if len(labels) != len(trees):
        parser.error("--labels needs one name per tree")
    tree_args = [tuple(shlex.split(a)) for a in args.tree_args] if args.tree_args else [()] * len(trees)
    if len(tree_args) != len(trees):
        parser.error("--tree-args needs one string per tree")
    modes = [True, False] if args.both else [not args.no_stream]  # streamed?
    cases = [(tree, label, commit, stream, extra) for tree, label, commit, extra in zip(trees, labels, commits, tree_args) for stream in modes]
    rows: dict[tuple, list[dict]] = {case: [] for case in cases}
    for index in range(args.rounds):
        for case in cases if index % 2 == 0 else cases[::-1]:
            tree, stream, extra = case[0], case[3], case[4]
            row = measure(tree, stream, args, extra)
            rows[case].append(row)
            print(f"round {index + 1} {tree} {'streamed' if stream else 'whole'}: {row['qps']:.1f} QPS, P99 {row['p99_ms']:.0f} ms, event loop "
                  f"{row['event_loop_share']:.1%} of the server's CPU ({row['event_loop_ms_per_request']:.2f} ms a request)", flush=True)
    how = "streamed and whole" if args.both else "whole answers" if args.no_stream else "streamed"
    print(f"\n{args.workload}, {args.users} users, {how}, {args.duration_s:g} s per run, median of {args.rounds} rounds:")
    document = {"kind": "event-loop-share", "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "command": "python " + shlex.join(sys.argv), "workload": args.workload, "users": args.users,
                "duration_s": args.duration_s, "streamed": None if args.both else not args.no_stream, "rounds": args.rounds, "cpu": cpu_description(),
                "trees": []}
    for case, measured in rows.items():
        _, label, commit, stream, extra = case
        median = {key: statistics.median(row[key] for row in measured) for key in measured[0]}
        document["trees"].append({"label": label, "commit": commit, "streamed": stream, "server_args": shlex.join(extra),
                                  "median": median, "runs": measured})
        print(f"  {label} ({commit}), {'streamed' if stream else 'whole'}: {median['qps']:.1f} QPS, P99 {median['p99_ms']:.0f} ms, event loop "
              f"{median['event_loop_share']:.1%} of the server's CPU, {median['event_loop_ms_per_request']:.2f} ms of it a request")
    if args.out is not None:
        args.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
