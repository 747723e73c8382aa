"""Where a served chapter 8's event loop spends its time: py-spy samples of the server under load, folded.

Starts chapter 8 as the side-by-side runs it (the climb's ``cpu`` profile, pinned to one core), keeps
``--users`` requests in flight with the side-by-side's client, samples the server with py-spy for
``--seconds`` (``--threads``, so each sample names its thread) and prints each thread's share of the
samples and, for the event loop (the main thread), the functions found most often on its stacks.

    python benchmarks/studies/event_loop/profile_loop.py --workload mixed > benchmarks/studies/event_loop/profile-streamed-mixed.txt
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks.harness.environment import cpu_description  # noqa: E402
from benchmarks.harness.server_process import running_module  # noqa: E402
from benchmarks.harness.streaming import harness_settings, run_closed_loop, summarize  # noqa: E402


def fold(raw: str, top: int, folded: str = "event loop") -> list[str]:
    """py-spy's ``raw`` output (one ``thread;frame;...;frame count`` per line) as a report: each thread's share,
    then the functions most often on the stacks of the thread named ``folded``."""
    per_thread: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    loop_total = 0
    for line in raw.splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread = "event loop" if "MainThread" in frames[0] else frames[0].split(": ", 1)[-1]
        per_thread[thread] += int(count)
        if thread != folded:
            continue
        loop_total += int(count)
        for name in {frame.split(" (")[0] + " (" + frame.rsplit("/", 1)[-1].split(":")[0] + ")" for frame in frames[1:]}:
            inclusive[name] += int(count)
    total = sum(per_thread.values())
    lines = ["samples per thread:"] + [f"  {thread:20s} {n:6d}  {n / total:6.1%}" for thread, n in per_thread.most_common()]
    lines += [f"{folded}: the {top} functions most often on its stacks (share of its {loop_total} samples; "
              "uvloop's own C code shows as Runner.run)"]
    lines += [f"  {n / loop_total:6.1%}  {name}" for name, n in inclusive.most_common(top)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--api", default="inference", choices=("inference", "openai"), help="the route: /v1/inference or OpenAI's /v1/completions")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--thread", default="event loop", help="whose functions to list: 'event loop' or another thread's name")
    args = parser.parse_args()
    harness, flags, env = harness_settings("cpu")
    stream = not args.no_stream
    with running_module("chapters.ch08_continuous_batching", flags, name="ch08", env=env, cpu_cores=harness["server_cores"]) as server, \
            tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        asyncio.run(run_closed_loop(server.url, 4, 2.0, args.workload, stream, seed=7, api=args.api))
        spy = subprocess.Popen(["py-spy", "record", "-p", str(server.pid), "-d", str(args.seconds), "-r", "50", "--threads",
                                "--nonblocking", "-f", "raw", "-o", raw.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records, window = asyncio.run(run_closed_loop(server.url, args.users, args.seconds + 5, args.workload, stream, seed=1234, api=args.api))
        spy.wait()
        summary = summarize(records, window, None, None, None)
        report = fold(Path(raw.name).read_text(), args.top, args.thread)
    how = "streamed" if stream else "whole answers"
    print(f"chapter 8, workload {args.workload}, {args.users} users, {how} ({args.api} route): {summary['qps']:.1f} QPS over the sampled run; "
          f"CPU: {cpu_description()}; py-spy at 50 Hz for {args.seconds} s")
    print("\n".join(report))


if __name__ == "__main__":
    main()
