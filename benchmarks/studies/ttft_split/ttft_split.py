"""Where chapter 8's time to first token goes: the client's TTFT beside the server's own, and the step split.

One chapter 8 server (the ``cpu`` profile's flags, pinned as ``benchmarks.harness.streaming compare --profile cpu``
pins it), a short warm-up, then ``--users`` streaming clients for ``--duration-s`` seconds. It prints
the client's TTFT and TPOT, the server's TTFT histogram (``/metrics``: from the request's arrival in
the backend to its first token, so HTTP and the event loop are outside it), and the median and P90 of
each step's tokens and phases (``/stats``), then the prefix cache's counters. Flags after ``--`` go to
the server:

    python -m benchmarks.studies.ttft_split.ttft_split --workload shared-prefix -- --prefix-caching=on
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.server_process import running_module
from benchmarks.harness.streaming import WORKLOADS, harness_settings, run_closed_loop, summarize


def split(workload: str, users: int, duration_s: float, server_flags: list[str]) -> str:
    harness, flags, env = harness_settings("cpu")
    with running_module("chapters.ch08_continuous_batching", [*flags, *server_flags], name="ttft-split", env=env,
                        cpu_cores=harness["server_cores"]) as server:
        asyncio.run(run_closed_loop(server.url, min(users, 4), 2.0, workload, True, seed=5))
        records, window = asyncio.run(run_closed_loop(server.url, users, duration_s, workload, True, seed=1234))
        stats = httpx.get(f"{server.url}/stats", timeout=10).json()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    client = summarize(records, window, None, None, None)
    lines = [f"ch08 {' '.join(server_flags) or '(defaults)'}, workload {workload}, {users} streaming users, {duration_s:g} s, "
             f"commit {harness['git_commit']}{' (dirty)' if harness['git_dirty'] else ''}",
             f"client: {client['qps']:.1f} QPS, TTFT P50 {client['ttft_ms']['p50']:.0f} ms, P99 {client['ttft_ms']['p99']:.0f} ms, "
             f"TPOT P50 {client['tpot_ms']['p50']:.1f} ms"]
    for family in text_string_to_metric_families(metrics):
        if family.name == "inference_time_to_first_token_seconds":
            buckets = [(s.labels["le"], int(s.value)) for s in family.samples if s.name.endswith("_bucket")]
            lines.append("server TTFT (arrival in the backend to first token, every request since start): "
                         + ", ".join(f"<= {le} s: {count}" for le, count in buckets))
    recent = stats["steps"]["recent"]
    for key in ("tokens", "decode_rows", "prefill_tokens", "running", "schedule_ms", "prepare_ms", "model_ms", "update_ms"):
        values = sorted(r[key] for r in recent)
        lines.append(f"step {key}: median {statistics.median(values):.2f}, P90 {values[int(len(values) * 0.9)]:.2f} (last {len(values)} steps)")
    lines.append(f"step time share since start: {stats['steps']['share']}")
    lines.append(f"prefix cache: {stats['scheduler']['prefix_cache']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.ttft_split.ttft_split", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="shared-prefix")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args(argv)
    print(split(args.workload, args.users, args.duration_s, args.server_flags))


if __name__ == "__main__":
    main()
