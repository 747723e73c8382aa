"""A py-spy speedscope profile in a few lines: per thread, its samples and the frames that hold most of them.

    python -m benchmarks.studies.ch08_shared_prefix.profile_summary benchmarks/studies/ch08_shared_prefix/profile-caching-on.speedscope.json.gz

(a ``.gz`` is read as it is; https://www.speedscope.app opens the file once unpacked.)
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import Counter


def summarize(path: str, top: int = 12) -> str:
    doc = json.load(gzip.open(path) if path.endswith(".gz") else open(path))
    frames = doc["shared"]["frames"]
    name = lambda i: f"{frames[i]['name']} ({frames[i].get('file', '').rsplit('/', 2)[-1]}:{frames[i].get('line', '')})"  # noqa: E731
    lines = []
    for profile in doc["profiles"]:
        samples = profile["samples"]
        if not samples:
            continue
        inclusive, own = Counter(), Counter()
        for stack in samples:
            for frame in set(stack):
                inclusive[frame] += 1
            own[stack[-1]] += 1
        lines.append(f"== {profile['name']}: {len(samples)} samples")
        below_root = [(f, n) for f, n in inclusive.most_common() if n < 0.99 * len(samples)][:top]  # not the frames every sample has
        lines.append("  inclusive: " + "; ".join(f"{100 * n / len(samples):.0f}% {name(f)}" for f, n in below_root))
        lines.append("  own: " + "; ".join(f"{100 * n / len(samples):.0f}% {name(f)}" for f, n in own.most_common(top)))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 12))
