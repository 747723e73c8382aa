"""Per-thread active samples of the committed serve-path profiles (``profile-<mode>-<process>.collapsed.gz``),
written to ``threads.txt``::

    python -m benchmarks.studies.serve_path.threads
"""

from __future__ import annotations

import collections
import gzip
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = {"thread": "Serve's default (user code on a thread of its own)", "nothread": "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0",
         "direct": "direct ingress (no Python proxy; HAProxy in front)"}


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


def main() -> None:
    out = ["| mode | process | thread | active samples (50/s over 12 s) |", "|---|---|---|---|"]
    for mode, how in MODES.items():
        for process in ("replica", "proxy"):
            if not (HERE / f"profile-{mode}-{process}.collapsed.gz").exists():  # direct ingress: no proxy
                continue
            for name, n in per_thread(HERE / f"profile-{mode}-{process}.collapsed.gz").most_common(5):
                out.append(f"| {how} | {process} | {name} | {n} |")
    (HERE / "threads.txt").write_text("\n".join(out) + "\n\nCommand: `python -m benchmarks.studies.serve_path.threads`\n")
    print((HERE / "threads.txt").read_text())


if __name__ == "__main__":
    main()
