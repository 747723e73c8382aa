"""Chapter 8 on the shared-prefix workload, streamed, from a cold cache: the client's figures, the
server's per-request trace (:mod:`.traced_server`) split into its parts, and optionally a py-spy profile.
With ``--whole``: whole answers on ``/v1/inference``, and the slowest of them beside the rest.

    python -m benchmarks.studies.ch08_shared_prefix.trace_run --label on -- --prefix-caching=on
    python -m benchmarks.studies.ch08_shared_prefix.trace_run --label off -- --prefix-caching=off

writes ``trace-<label>.txt`` (the summary) beside this file, and with ``--py-spy`` a speedscope
profile of the server, every thread (``profile-<label>.speedscope.json``; the study commits it gzipped).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness.server_process import running_module
from benchmarks.harness.streaming import harness_settings, run_closed_loop, summarize

HERE = Path(__file__).parent
MIN_WORKLOAD_PROMPT = 256  # the workload's prompts are a 256-token prefix and more; the server's readiness probes send a few tokens
PINNED = ["--precision=fp32", "--attention=flex"]  # as the prefix-caching comparison pins them: no start-up measuring


def quantiles(values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return "none"
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return f"P50 {statistics.median(values):.1f}, P90 {pick(0.9):.1f}, P99 {pick(0.99):.1f}"


def summarize_trace(lines: list[dict], start: float, since: float) -> list[str]:
    """The server's side of each first token (milliseconds) for the requests that arrived after ``start`` (the
    load's, on the same monotonic clock: not the server's own warm-up), cold start (first ``since`` s) and steady state apart."""
    lines = [r for r in lines if r.get("kind") != "answer" and r["arrived"] >= start and r["prompt"] >= MIN_WORKLOAD_PROMPT]
    if not lines:
        return ["no trace"]
    out = []
    for name, part in (("cold (first %g s)" % since, [r for r in lines if r["arrived"] - start < since]),
                       ("steady", [r for r in lines if r["arrived"] - start >= since])):
        if not part:
            continue
        ms = lambda key: [r[key] * 1e3 for r in part]  # noqa: E731
        out += [f"{name}: {len(part)} requests; prefix positions found cached: "
                f"{sum(r['cached'] for r in part) / sum(r['prompt'] for r in part):.3f} of the prompts' positions, "
                f"{sum(1 for r in part if r['cached'] == 0)} requests found none",
                f"  server TTFT ms (arrival -> first token): {quantiles([(r['first_token_at'] - r['arrived']) * 1e3 for r in part])}",
                f"  waiting for its first step ms (arrival -> that step began): {quantiles([(r['first_step_at'] - r['arrived']) * 1e3 for r in part])}",
                f"  its steps ms (that step began -> first token): {quantiles([(r['first_token_at'] - r['first_step_at']) * 1e3 for r in part])}",
                f"  steps it took part in before its first token: {quantiles([r['steps_to_first'] for r in part])}",
                f"  the step that gave its first token: ms {quantiles(ms('step_s'))}; "
                f"decode rows {quantiles([r['step_decodes'] for r in part])}; prompt tokens {quantiles([r['step_prefill_tokens'] for r in part])}",
                f"  queue length when admitted: {quantiles([r['waiting_at_admission'] for r in part])}"]
    return out


def summarize_answers(lines: list[dict], start: float, slowest: float) -> list[str]:
    """Whole answers (the trace's ``answer`` lines that arrived after ``start``): the slowest ``slowest`` of them beside
    the rest, each by the medians of what a request met on its way (seconds unless named)."""
    answers = sorted((r for r in lines if r["arrived"] >= start and r["prompt"] >= MIN_WORKLOAD_PROMPT),
                     key=lambda r: r["finished_at"] - r["arrived"])
    if not answers:
        return ["no answers traced"]
    cut = max(1, round(len(answers) * slowest))
    columns = {"server latency": lambda r: r["finished_at"] - r["arrived"],
               "arrived after the load began": lambda r: r["arrived"] - start,
               "waited for its first step": lambda r: r["first_step_at"] - r["arrived"],
               "first token after arrival": lambda r: r["first_token_at"] - r["arrived"],
               "steps it took part in": lambda r: r["steps"], "their seconds": lambda r: r["steps_s"],
               "its longest step": lambda r: r["longest_step_s"],
               "other requests' prompt tokens in its steps": lambda r: r["others_prompt_tokens"],
               "prompt positions found cached": lambda r: r["cached"], "running when admitted": lambda r: r["running_at_admission"],
               "preemptions": lambda r: r["preemptions"]}
    out = [f"whole answers: {len(answers)}; the slowest {cut} ({slowest:.0%}) beside the other {len(answers) - cut}, medians:",
           "| | slowest | the rest |", "|---|---|---|"]
    for name, value in columns.items():
        out.append(f"| {name} | {statistics.median(map(value, answers[-cut:])):,.3f} | {statistics.median(map(value, answers[:-cut])) if answers[:-cut] else 0:,.3f} |")
    out.append("the slowest, one by one (arrived s, latency s, first token s, steps, their s, others' prompt tokens, cached, preemptions): "
               + "; ".join(f"{r['arrived'] - start:.2f}, {r['finished_at'] - r['arrived']:.3f}, {r['first_token_at'] - r['arrived']:.3f}, "
                           f"{r['steps']}, {r['steps_s']:.3f}, {r['others_prompt_tokens']}, {r['cached']}, {r['preemptions']}"
                           for r in answers[-cut:]))
    out += ["by the second they arrived in: answers, server latency P50 and max (s), mean step of their answers P50 (ms):",
            "; ".join(f"{second} s: {len(part)}, {statistics.median(r['finished_at'] - r['arrived'] for r in part):.3f}, "
                      f"{max(r['finished_at'] - r['arrived'] for r in part):.3f}, {statistics.median(r['steps_s'] / r['steps'] for r in part) * 1e3:.1f}"
                      for second, part in itertools.groupby(sorted(answers, key=lambda r: r["arrived"]),
                                                            key=lambda r: int(r["arrived"] - start))
                      for part in [list(part)])]
    return out


def resummarize(path: Path, cold_s: float) -> str:
    """The trace part of a summary again, from a raw trace kept in the temporary directory (the load's start: its first prompt)."""
    trace = [json.loads(line) for line in path.read_text().splitlines() if line]
    return "\n".join(summarize_trace(trace, min(r["arrived"] for r in trace if r["prompt"] >= MIN_WORKLOAD_PROMPT), cold_s))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--cold-s", type=float, default=3.0, help="requests that arrive this soon after the first are the cold start")
    parser.add_argument("--py-spy", action="store_true", help="record the server with py-spy (every thread, idle off)")
    parser.add_argument("--no-hold", action="store_true", help="the scheduler without holding requests for a prefix in flight")
    parser.add_argument("--whole", action="store_true", help="whole answers on /v1/inference (default: streamed), and the slowest traced")
    parser.add_argument("--slowest", type=float, default=0.01, help="the share of whole answers called the slowest")
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("server_flags", nargs="*")
    args = parser.parse_args(argv)
    harness, flags, env = harness_settings("cpu")
    trace_path = Path(tempfile.mkstemp(prefix="ch08-trace-", suffix=".jsonl")[1])
    env = {**env, "CH08_TRACE": str(trace_path), "CH08_NO_HOLD": "1" if args.no_hold else "0"}
    server_flags = [*flags, *PINNED, *args.server_flags]
    with running_module("benchmarks.studies.ch08_shared_prefix.traced_server", server_flags, name="ch08-traced", env=env,
                        cpu_cores=harness["server_cores"]) as server:
        spy = None
        if args.py_spy:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-r", "200", "--threads", "-f", "speedscope",
                                    "-o", str(args.out_dir / f"profile-{args.label}.speedscope.json"), "--pid", str(server.pid),
                                    "-d", str(int(args.duration_s) + 1)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        load_start = time.perf_counter()  # CLOCK_MONOTONIC, as the server's
        records, window = asyncio.run(run_closed_loop(server.url, args.users, args.duration_s, "shared-prefix", not args.whole, seed=1234))
        stats = httpx.get(f"{server.url}/stats", timeout=10).json()
        if spy is not None:
            spy.wait(timeout=60)
    client = summarize(records, window, None, None, None)
    trace = [json.loads(line) for line in trace_path.read_text().splitlines() if line]
    os.replace(trace_path, Path(tempfile.gettempdir()) / f"ch08-trace-{args.label}.jsonl")  # the raw trace, not committed
    users = f"{args.users} {'users, whole answers on /v1/inference' if args.whole else 'streaming users'}"
    client_line = (f"client: {client['qps']:.1f} QPS, e2e P50 {client['e2e_ms']['p50']:.0f} ms, P99 {client['e2e_ms']['p99']:.0f} ms"
                   if args.whole else
                   f"client: {client['qps']:.1f} QPS, TTFT P50 {client['ttft_ms']['p50']:.0f} ms, P99 {client['ttft_ms']['p99']:.0f} ms, "
                   f"TPOT P50 {client['tpot_ms']['p50']:.1f} ms, e2e P99 {client['e2e_ms']['p99']:.0f} ms")
    lines = [f"ch08 {' '.join(server_flags)}{' (no hold)' if args.no_hold else ''}, shared-prefix, {users}, {args.duration_s:g} s from a cold cache, "
             f"commit {harness['git_commit']}{' (dirty)' if harness['git_dirty'] else ''}",
             client_line,
             *(summarize_answers([r for r in trace if r.get("kind") == "answer"], load_start, args.slowest) if args.whole
               else summarize_trace(trace, load_start, args.cold_s)),
             f"scheduler: preemptions {stats['scheduler']['preemptions']}, steps {stats['scheduler']['steps']}, "
             f"tokens/step {stats['scheduler']['tokens_per_step']}, prefix cache {stats['scheduler']['prefix_cache']}",
             f"step time share: {stats['steps']['share']}"]
    text = "\n".join(lines)
    (args.out_dir / f"trace-{args.label}.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
