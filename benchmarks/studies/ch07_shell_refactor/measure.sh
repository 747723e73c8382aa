#!/usr/bin/env bash
# Chapter 7 before and after its shell was made to wrap any backend (readiness from a real request,
# the backend read through a state reader): the same load on both, two interleaved rounds, 64 users,
# default workload, whole answers (chapter 7 does not stream), both servers at their defaults,
# started one after the other. From the repository root:
#   bash benchmarks/studies/ch07_shell_refactor/measure.sh [BEFORE_COMMIT]
set -euo pipefail
before=${1:-3ecc2f6}
out=benchmarks/studies/ch07_shell_refactor
tree=$(mktemp -d)
git worktree add -q --detach "$tree" "$before"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; git worktree remove --force "$tree"; }
trap cleanup EXIT
(cd "$tree" && exec python -m chapters.ch07_production --port 8111 --log-level warning) & pids+=($!)
until curl -sf http://127.0.0.1:8111/readyz >/dev/null; do sleep 1; done
python -m chapters.ch07_production --port 8112 --log-level warning & pids+=($!)
until curl -sf http://127.0.0.1:8112/readyz >/dev/null; do sleep 1; done
for round in 1 2; do
  python -m benchmarks.harness.streaming run --no-stream --url http://127.0.0.1:8111 --users 64 --duration-s 30 --workload default \
      --out "$out/before-round$round.json" >/dev/null
  python -m benchmarks.harness.streaming run --no-stream --url http://127.0.0.1:8112 --users 64 --duration-s 30 --workload default \
      --out "$out/after-round$round.json" >/dev/null
done
python - "$out" "$before" <<'PY'
import json, statistics, sys
from pathlib import Path
out, before = Path(sys.argv[1]), sys.argv[2]
runs = {kind: [json.loads(p.read_text()) for p in sorted(out.glob(f"{kind}-round*.json"))] for kind in ("before", "after")}
qps = {kind: statistics.median(r["qps"] for r in rs) for kind, rs in runs.items()}
p99 = {kind: statistics.median(r["e2e_ms"]["p99"] for r in rs) for kind, rs in runs.items()}
lines = [f"chapter 7 at commit {before} (before) against chapter 7 now (after), 64 users, default workload, "
         f"median of {len(runs['after'])} interleaved rounds",
         f"QPS: before {qps['before']:.1f}, after {qps['after']:.1f}, ratio {qps['after'] / qps['before']:.3f}",
         f"P99 (ms): before {p99['before']:.0f}, after {p99['after']:.0f}, ratio {p99['after'] / p99['before']:.3f}"]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
