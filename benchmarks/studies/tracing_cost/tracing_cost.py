"""What tracing costs chapter 8: the same server with and without ``--otlp-endpoint``, side by side.

A collector that accepts and drops every export (:class:`DroppingCollector`, OTLP/HTTP on loopback,
in this process: it runs on the load generator's core, so the server pays only its own side, the
spans and the exporter's thread) receives the spans; the streaming harness runs chapter 8 with
tracing off and on in alternating rounds, pinned as the climb pins a server. Writes the harness's
JSON and, beside this file, ``results.txt`` (read by chapter 8's RESULTS.md)::

    python -m benchmarks.studies.tracing_cost.tracing_cost --workload default --users 64 --duration-s 20 --rounds 3
"""

from __future__ import annotations

import argparse
import shlex
import sys
import json
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.harness import streaming
from benchmarks.harness.results import REFERENCE_ROOT

HERE = Path(__file__).resolve().parent
LABELS = ("tracing-off", "tracing-on")


class _Drop(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.exports += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


class DroppingCollector(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint on 127.0.0.1 that answers 200 to every export and keeps nothing but a count."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Drop)
        self.exports = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def summary(document: dict, exports: int, command: str) -> str:
    """The text table of results.txt: each label's QPS, latencies and the on/off ratios."""
    servers = document["chapters"]
    rows = ["| server | QPS | E2E P50 / P99 (ms) | TTFT P50 / P99 (ms) | QPS rounds |", "|---|---|---|---|---|"]
    for label in LABELS:
        s = servers[label]
        rounds = ", ".join(f"{r['qps']:.1f}" for r in s.get("rounds", [s]))
        rows.append(f"| {label} | {s['qps']:.1f} | {s['e2e_ms']['p50']:,.0f} / {s['e2e_ms']['p99']:,.0f} | "
                    f"{s['ttft_ms']['p50']:,.0f} / {s['ttft_ms']['p99']:,.0f} | {rounds} |")
    on, off = servers["tracing-on"], servers["tracing-off"]
    per_round = [a["qps"] / b["qps"] for a, b in zip(on.get("rounds", [on]), off.get("rounds", [off]), strict=False)]
    return "\n".join([*rows, "",
                      f"tracing on / off, QPS: {on['qps'] / off['qps']:.2f}x (per round: {', '.join(f'{r:.2f}' for r in per_round)}; "
                      f"median {statistics.median(per_round):.2f}); P99 E2E: {on['e2e_ms']['p99'] / off['e2e_ms']['p99']:.2f}x. "
                      f"Workload `{document['workload']}`, {document['users']} streaming users, {document['duration_s']:.0f} s a round, "
                      f"{document['rounds']} rounds alternating; {exports} exports received. Command: `{command}`"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.tracing_cost.tracing_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="default")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REFERENCE_ROOT / "cpu" / "ch08" / "tracing-cost.json")
    args = parser.parse_args(argv)
    collector = DroppingCollector()
    try:
        streaming.main(["compare", "--profile", "cpu", "--variant", "tracing-off=ch08",
                        "--variant", f"tracing-on=ch08:--otlp-endpoint={collector.url}", "--workload", args.workload,
                        "--users", str(args.users), "--duration-s", str(args.duration_s), "--rounds", str(args.rounds),
                        "--out", str(args.out)])
    finally:
        collector.shutdown()
    command = "python -m benchmarks.studies.tracing_cost.tracing_cost " + shlex.join(sys.argv[1:] if argv is None else argv)
    (HERE / "results.txt").write_text(summary(json.loads(args.out.read_text()), collector.exports, command) + "\n")
    print((HERE / "results.txt").read_text())


if __name__ == "__main__":
    main()
