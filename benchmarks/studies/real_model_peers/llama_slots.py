"""What ``llama-server``'s slots did, from its log: how many prompt tokens each request evaluated, and how long its
prompt and its answer took, by the ten seconds of server time in which it finished.

``peers compare`` starts one ``llama-server`` per round and leaves its log in the system's temporary directory
(``llama-server-*.log``); a request that finds its slot holding the start of its prompt evaluates only the rest::

    python -m benchmarks.studies.real_model_peers.llama_slots /tmp/llama-server-XXXX.log
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

# "1.00.124.958 I slot print_timing: id  0 | task 99 | prompt eval time =    5605.88 ms /   264 tokens (...)"
TIMING = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.\d+ .*print_timing: id +(\d+) \| task +(\d+) \| +(prompt eval|eval) time = +([\d.]+) ms / +(\d+) tokens")
WHOLE_PROMPT = 200  # tokens: the workloads' shared prompts are longer, the parts of their own shorter


def requests(log: str) -> list[dict]:
    """One record per finished request: ``finished_s`` (server time), ``prompt_tokens`` evaluated, ``prompt_ms``,
    ``decode_ms_per_token``."""
    found: dict[tuple[int, int], dict] = {}
    for line in log.splitlines():
        if not (match := TIMING.match(line)):
            continue
        minutes, seconds, millis, slot, task, kind, ms, tokens = match.groups()
        record = found.setdefault((int(slot), int(task)), {"finished_s": int(minutes) * 60 + int(seconds) + int(millis) / 1e3})
        if kind == "prompt eval":
            record.update(prompt_tokens=int(tokens), prompt_ms=float(ms))
        else:
            record["decode_ms_per_token"] = float(ms) / max(int(tokens), 1)
    return sorted((r for r in found.values() if "prompt_tokens" in r and "decode_ms_per_token" in r), key=lambda r: r["finished_s"])


def summary(records: list[dict], bucket_s: int = 10) -> str:
    by_bucket: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        by_bucket[int(record["finished_s"] // bucket_s) * bucket_s].append(record)
    lines = [f"| finished (server s) | requests | evaluated their whole prompt (>= {WHOLE_PROMPT} tokens) | prompt tokens "
             "evaluated, median | prompt s, median | decode ms per token, median |", "|---|---|---|---|---|---|"]
    for start, group in sorted(by_bucket.items()):
        whole = sum(r["prompt_tokens"] >= WHOLE_PROMPT for r in group)
        lines.append(f"| {start}-{start + bucket_s} | {len(group)} | {whole} | {statistics.median(r['prompt_tokens'] for r in group):.0f} | "
                     f"{statistics.median(r['prompt_ms'] for r in group) / 1e3:.1f} | "
                     f"{statistics.median(r['decode_ms_per_token'] for r in group):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a llama-server log")
    args = parser.parse_args(argv)
    print(summary(requests(args.log.read_text(errors="replace"))))


if __name__ == "__main__":
    main()
