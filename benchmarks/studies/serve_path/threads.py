"""Per-thread active samples of the committed serve-path profiles (``profile-<mode>-<process>.collapsed.gz``),
and, for the per-request path (``runs64``), where the proxy's and the replica's samples outside the step thread
were, by package, written to ``threads.txt``::

    python -m benchmarks.studies.serve_path.threads
"""

from __future__ import annotations

import collections
import gzip
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = {"thread": "Serve's default (user code on a thread of its own)", "nothread": "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0",
         "direct": "direct ingress (no Python proxy; HAProxy in front)",
         "runs64": "Serve's default, runs of 64 (about two messages per answer)"}
# Python frames every sample of a thread passes through (its start-up and its event loop's run), not where time goes
SCAFFOLD = re.compile(r"^(Thread\.|<module> |Worker\.main_loop|.*_run_user_code_event_loop|.*_run_router_event_loop|"
                      r"BaseEventLoop\.run_forever|BaseEventLoop\._run_once|Runner\.run|run )")
PYTHON_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*\.py):\d+\)$")


def per_thread(path: Path) -> collections.Counter:
    """Samples per thread name (py-spy's ``thread (TID): NAME`` without the id) in one collapsed profile."""
    counts: collections.Counter = collections.Counter()
    with gzip.open(path, "rt") as lines:
        for line in lines:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            first = stack.split(";")[0]
            name = re.sub(r"^thread \(\d+\):? ?", "", first) or "(unnamed thread)"
            counts[re.sub(r"Thread-\d+ ", "", name)] += int(n)
    return counts


def by_package(path: Path, skip: str = "step-thread") -> tuple[int, collections.Counter]:
    """Active samples outside the ``skip`` thread, by the package of the innermost Python frame that is not scaffolding
    (``ray``, ``grpc``, ``asyncio``, ``chapters``...); a sample with none ran native code under the loop (the loop's
    own, gRPC's poller, Ray's core worker). Recorded without ``--native``: with it, these profiles also counted the
    loops' threads waiting in ``epoll`` as active, which is waiting, not work."""
    total, counts = 0, collections.Counter()
    with gzip.open(path, "rt") as lines:
        for line in lines:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if skip in frames[0]:
                continue
            total += int(n)
            python = [m for m in map(PYTHON_FRAME.match, frames[1:]) if m and not SCAFFOLD.match(m["name"])]
            if python:
                counts[python[-1]["file"].split("/")[0].removesuffix(".py")] += int(n)
            else:
                counts["native code under the loop"] += int(n)
    return total, counts


def main() -> None:
    out = ["| mode | process | thread | active samples (50/s over 12 s) |", "|---|---|---|---|"]
    for mode, how in MODES.items():
        for process in ("replica", "proxy"):
            if not (HERE / f"profile-{mode}-{process}.collapsed.gz").exists():  # direct ingress: no proxy
                continue
            for name, n in per_thread(HERE / f"profile-{mode}-{process}.collapsed.gz").most_common(5):
                out.append(f"| {how} | {process} | {name} | {n} |")
    for process in ("proxy", "replica"):
        path = HERE / f"profile-runs64-{process}.collapsed.gz"
        if not path.exists():
            continue
        total, counts = by_package(path)
        out += ["", f"Runs of 64, the {process} outside the step thread: {total} active samples, by where each was "
                "(the package of its innermost Python frame below the event loop's own):", "", "| where | samples |", "|---|---|"]
        out += [f"| {name} | {n} |" for name, n in counts.most_common(10)]
    (HERE / "threads.txt").write_text("\n".join(out) + "\n\nCommand: `python -m benchmarks.studies.serve_path.threads`\n")
    print((HERE / "threads.txt").read_text())


if __name__ == "__main__":
    main()
