#!/usr/bin/env bash
# Every chapter at the commit before a change (BASE, a checkout) against this tree, at 64 users,
# interleaved rounds (base, then this, chapter by chapter), each run by its own tree's harness.
# Prints each chapter's QPS per round and the ratio of the medians.
#   ROUNDS=2 BASE=/tmp/base bash benchmarks/harness/compare_commits.sh     (BASE default: a worktree of 0430de0)
set -u
cd "$(dirname "$0")/../.."  # the repository root
REPO=$(pwd)
BASE=${BASE:-/tmp/base}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-$(mktemp -d)}
CHAPTERS=${CHAPTERS:-"ch01 ch02 ch03 ch04 ch05 ch06"}
[ -d "$BASE" ] || git worktree add -q "$BASE" 0430de0
for r in $(seq 1 "$ROUNDS"); do
  for ch in $CHAPTERS; do
    (cd "$BASE" && timeout 300 python3 -m benchmarks run --chapter "$ch" --profile cpu --levels 64 --out "$OUT/base-r$r" > "$OUT/base-$ch-r$r.log" 2>&1)
    (cd "$REPO" && timeout 300 python3 -m benchmarks run --chapter "$ch" --profile cpu --levels 64 --no-calibration --out "$OUT/new-r$r" > "$OUT/new-$ch-r$r.log" 2>&1)
  done
done
OUT="$OUT" CHAPTERS="$CHAPTERS" python3 - <<'PY'
import collections, glob, json, os, statistics
qps = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "*-r*", "*.json"))):
    tree = os.path.basename(os.path.dirname(path)).split("-")[0]
    qps[(os.path.basename(path)[:-5], tree)].append(json.load(open(path))["levels"][-1]["qps"])
for ch in os.environ["CHAPTERS"].split():
    base, new = qps.get((ch, "base"), []), qps.get((ch, "new"), [])
    if base and new:
        print(ch, "base", [round(x, 1) for x in base], "new", [round(x, 1) for x in new],
              "ratio of medians", round(statistics.median(new) / statistics.median(base), 3))
PY
