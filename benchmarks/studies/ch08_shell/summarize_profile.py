"""Fold py-spy's collapsed stacks (``--threads --format raw``) per thread role into the functions
that take the largest share of that thread's samples (inclusive: a function counts once per stack).

    python summarize_profile.py A.collapsed B.collapsed ...
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

# The step thread was called EngineLoop before the shell (commit d3828f7).
ROLES = (("step thread", "StepThread"), ("step thread", "EngineLoop"), ("event loop", "run_forever"))
RATE_HZ, SAMPLED_S = 100, 25  # profile.sh's py-spy --rate and --duration
FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def role_of(frames: list[str]) -> str:
    for role, marker in ROLES:
        if any(marker in f for f in frames):
            return role
    return "other"


def short(frame: str) -> str:
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match["file"].split("site-packages/")[-1].split("/main/")[-1]
    return f"{match['func']} ({path})"


def summarize(path: Path, top: int = 25) -> str:
    samples: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        role = role_of(frames)
        samples[role] += int(count)
        seen = {short(f) for f in frames[1:]}  # the first frame names the thread
        inclusive.setdefault(role, Counter()).update({f: int(count) for f in seen})
    lines = [f"== {path.name}: samples per thread role " + ", ".join(f"{r} {n}" for r, n in samples.most_common())]
    load = path.with_name(path.stem + "-load.json")  # the load that ran while py-spy sampled
    if load.exists():
        qps = json.loads(load.read_text())["qps"]
        lines.append(f"load: {qps:.1f} answers/s; CPU per answer: event loop {samples['event loop'] / RATE_HZ / (qps * SAMPLED_S) * 1e3:.1f} ms, "
                     f"step thread {samples['step thread'] / RATE_HZ / (qps * SAMPLED_S) * 1e3:.1f} ms")
    for role in ("event loop", "step thread"):
        total = samples[role] or 1
        lines.append(f"-- {role}: share of its samples in each function (inclusive), top {top}")
        lines += [f"{n / total:7.1%}  {f}" for f, n in inclusive.get(role, Counter()).most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(summarize(Path(p)) for p in sys.argv[1:]))
