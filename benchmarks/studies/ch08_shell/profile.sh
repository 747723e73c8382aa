#!/usr/bin/env bash
# Where the shell's cost goes: py-spy samples chapter 8 without the shell (the commit before it) and
# in it (this tree), each under the same load as measure.sh (64 users, default workload, attention
# flex), one after the other; summarize_profile.py folds the samples per thread (the event loop,
# the step thread) into the functions that take the most of each. From the repository root:
#   bash benchmarks/studies/ch08_shell/profile.sh [BEFORE_COMMIT]
# Needs py-spy on PATH (pip install py-spy; a sampling profiler, nothing to change in the server).
set -euo pipefail
before=${1:-d3828f7}
out=benchmarks/studies/ch08_shell
tree=$(mktemp -d)
git worktree add -q --detach "$tree" "$before"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; git worktree remove --force "$tree"; }
trap cleanup EXIT
profile() {  # $1: label, $2: directory to run the server from, $3: port, $4: readiness path
  (cd "$2" && exec python -m chapters.ch08_continuous_batching --port "$3" --log-level warning --attention flex) & local pid=$!
  pids+=("$pid")
  until curl -sf "http://127.0.0.1:$3$4" >/dev/null; do sleep 1; done
  python -m benchmarks.harness.streaming run --url "http://127.0.0.1:$3" --users 64 --duration-s 40 --workload default \
      --out "$out/profile-$1-load.json" >/dev/null &
  local load=$!
  sleep 8  # past the ramp-up: sample the steady state
  py-spy record --pid "$pid" --rate 100 --duration 25 --threads --format raw --nonblocking -o "$out/profile-$1.collapsed" >/dev/null
  wait "$load"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
profile without-shell "$tree" 8101 /healthz
profile in-shell . 8102 /readyz
python benchmarks/studies/ch08_shell/summarize_profile.py "$out/profile-without-shell.collapsed" "$out/profile-in-shell.collapsed" \
    > "$out/profile-summary.txt"
cat "$out/profile-summary.txt"
