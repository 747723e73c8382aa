#!/usr/bin/env bash
# Chapter 8 inside chapter 7's shell against chapter 8 without it (the commit before the shell),
# 64 users, default workload, two interleaved rounds, both servers at their defaults except the
# attention backend, named (flex) so that the start-up rule's noisy choice cannot differ between
# them; client and server on the machine's cores unpinned (as the side-by-side rounds). From the
# repository root:
#   ROUNDS=4 bash benchmarks/studies/ch08_shell/measure.sh [BEFORE_COMMIT]   (ROUNDS: 2 by default)
set -euo pipefail
before=${1:-d3828f7}
out=benchmarks/studies/ch08_shell
tree=$(mktemp -d)
git worktree add -q --detach "$tree" "$before"
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; git worktree remove --force "$tree"; }
pids=()
trap cleanup EXIT
# One after the other: each measures its rules at start-up (engine, bf16 crossover, attention),
# and two servers measuring at once would each see the other's load.
(cd "$tree" && exec python -m chapters.ch08_continuous_batching --port 8101 --log-level warning --attention flex) & pids+=($!)
until curl -sf http://127.0.0.1:8101/healthz >/dev/null; do sleep 1; done
python -m chapters.ch08_continuous_batching --port 8102 --log-level warning --attention flex & pids+=($!)
until curl -sf http://127.0.0.1:8102/readyz >/dev/null; do sleep 1; done
# What each server chose at start-up (engine, attention, KV cache dtype), beside the figures.
curl -sf http://127.0.0.1:8101/healthz > "$out/without-shell-healthz.json"
curl -sf http://127.0.0.1:8102/healthz > "$out/in-shell-healthz.json"  # the shell's: the backend's under "backend"
rm -f "$out"/*-round*.json
for round in $(seq 1 "${ROUNDS:-2}"); do
  python -m benchmarks.harness.streaming run --url http://127.0.0.1:8101 --users 64 --duration-s 30 --workload default \
      --out "$out/without-shell-round$round.json" >/dev/null
  python -m benchmarks.harness.streaming run --url http://127.0.0.1:8102 --users 64 --duration-s 30 --workload default \
      --out "$out/in-shell-round$round.json" >/dev/null
done
python - "$out" "$before" "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- chapters shared || echo '+changes')" <<'PY'
import json, statistics, sys
from pathlib import Path
out, before, after = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = {kind: [json.loads(p.read_text()) for p in sorted(out.glob(f"{kind}-round*.json"))] for kind in ("without-shell", "in-shell")}
qps = {kind: statistics.median(r["qps"] for r in rs) for kind, rs in runs.items()}
p99 = {kind: statistics.median(r["e2e_ms"]["p99"] for r in rs) for kind, rs in runs.items()}
lines = [f"chapter 8 without the shell (commit {before}) against chapter 8 in chapter 7's shell (commit {after}), 64 users, default workload, "
         f"median of {len(runs['in-shell'])} interleaved rounds",
         "rounds (QPS): without " + ", ".join(f"{r['qps']:.1f}" for r in runs["without-shell"])
         + "; in shell " + ", ".join(f"{r['qps']:.1f}" for r in runs["in-shell"]),
         f"QPS: without {qps['without-shell']:.1f}, in shell {qps['in-shell']:.1f}, ratio {qps['in-shell'] / qps['without-shell']:.3f}",
         f"P99 (ms): without {p99['without-shell']:.0f}, in shell {p99['in-shell']:.0f}, ratio {p99['in-shell'] / p99['without-shell']:.3f}"]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
