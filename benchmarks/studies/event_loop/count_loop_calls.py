"""How many Python function calls chapter 8's event loop makes per streamed token: cProfile's counts.

A count does not depend on how fast the machine ran, which the loop's CPU share does. Starts chapter 8
as the side-by-side runs it (the climb's ``cpu`` profile, pinned to one core) with a profiler armed in
its main thread, the event loop's: ``SIGUSR1`` starts it after a warm-up, ``SIGUSR2`` stops it and
writes the counts, so start-up and warm-up are not counted. The step thread is never profiled.
Prints the calls per streamed token (tokens: calls of ``token_event``, one per token streamed on
``/v1/inference``), the writes per token (uvicorn's ``send``), and the functions called most.

    python benchmarks/studies/event_loop/count_loop_calls.py --workload mixed > benchmarks/studies/event_loop/loop-calls-mixed.txt
    python benchmarks/studies/event_loop/count_loop_calls.py --workload mixed --server-args=--stream-interval=16 > ...

cProfile's times are left out: on one core they include whatever the step thread ran meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import shlex
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import benchmarks.harness.server_process as server_process  # noqa: E402
from benchmarks.harness.environment import cpu_description  # noqa: E402
from benchmarks.harness.streaming import harness_settings, run_closed_loop, summarize  # noqa: E402

MODULE = "chapters.ch08_continuous_batching"

# Runs in the server process: the module as ``python -m`` would, with a profiler the two signals arm and stop.
LAUNCHER = """
import cProfile, runpy, signal, sys
profile, out = cProfile.Profile(), sys.argv.pop(1)
def start(*_): profile.enable()
def stop(*_):
    profile.disable()
    profile.dump_stats(out + ".part")
    __import__("os").replace(out + ".part", out)
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
runpy.run_module(%r, run_name="__main__")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--server-args", default="", help="extra flags for the server, written --server-args=FLAGS")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    harness, flags, env = harness_settings("cpu")
    flags = [*flags, *shlex.split(args.server_args)]
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "loop.prof"
        launcher = LAUNCHER % MODULE
        server_process.server_command = lambda module, port, extra=(): [sys.executable, "-c", launcher, str(out), "--port", str(port), *extra]
        with server_process.running_module(MODULE, flags, name="ch08", env=env, cpu_cores=harness["server_cores"]) as server:
            asyncio.run(run_closed_loop(server.url, 4, 2.0, args.workload, True, seed=1))
            os.kill(server.pid, signal.SIGUSR1)
            records, window = asyncio.run(run_closed_loop(server.url, args.users, args.seconds, args.workload, True, seed=1234))
            os.kill(server.pid, signal.SIGUSR2)
            asyncio.run(_until(out.exists))
        stats = pstats.Stats(str(out))
    summary = summarize(records, window, None, None, None)
    counts: dict[str, int] = {}
    for (filename, line, name), (primitive, total, *_rest) in stats.stats.items():
        where = f"{name} ({_short(filename)}:{line})" if line else name
        counts[where] = counts.get(where, 0) + total
    tokens = sum(n for where, n in counts.items() if where.startswith("token_event (") and "ch08_continuous_batching/streaming.py" in where)
    writes = sum(n for where, n in counts.items() if where.startswith("send (") and "httptools_impl.py" in where)
    calls = sum(counts.values())
    print(f"chapter 8, workload {args.workload}, {args.users} users, streamed{', ' + args.server_args if args.server_args else ''}: "
          f"{summary['qps']:.1f} QPS over the counted {window:.0f} s; CPU: {cpu_description()}")
    print(f"event loop: {calls:,} Python calls for {tokens:,} streamed tokens = {calls / max(tokens, 1):.0f} calls a token; "
          f"{writes:,} body writes = {writes / max(tokens, 1):.2f} a token")
    print(f"the {args.top} functions called most, calls per streamed token:")
    for where, n in sorted(counts.items(), key=lambda item: -item[1])[:args.top]:
        print(f"  {n / max(tokens, 1):7.2f}  {where}")


async def _until(condition, limit_s: float = 60.0) -> None:
    """Wait for the server to write its counts (a file appearing: nothing to await but the file system)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise SystemExit("the server never wrote its profile")
        await asyncio.sleep(0.1)


def _short(filename: str) -> str:
    """A path from the package on: ``.../site-packages/starlette/responses.py`` -> ``starlette/responses.py``."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "chapters", "shared", "python3.11"):
        if anchor in parts:
            index = parts.index(anchor)
            return "/".join(parts[index + (anchor != "chapters" and anchor != "shared"):])
    return filename


if __name__ == "__main__":
    main()
