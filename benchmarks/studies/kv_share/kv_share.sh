#!/usr/bin/env bash
# Chapter 4 under the cpu profile's top load (64 users): share of the pool reserved and written, before
# and after one ledger. BASE is a checkout of the commit before (default: a git worktree of 0430de0 in
# /tmp/base, made here if missing); the server on core 0, the load on core 1, loopback only.
set -u
cd "$(dirname "$0")/../../.."  # the repository root
REPO=$(pwd)
BASE=${BASE:-/tmp/base}
[ -d "$BASE" ] || git worktree add -q "$BASE" 0430de0
run_one() {  # tree label port
  local tree=$1 label=$2 port=$3
  (cd $tree && exec env OMP_NUM_THREADS=1 taskset -c 0 python3 -m chapters.ch04_memory_pool --port $port --torch-threads 1 --log-level warning > /tmp/kv-server-$label.log 2>&1) &
  local pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:$port/healthz > /dev/null && break; sleep 0.5; done
  (cd "$REPO" && taskset -c 1 python3 -m benchmarks.studies.kv_share.kv_share --url http://127.0.0.1:$port --users 64 --seconds 20 --label "$label" --out benchmarks/reference/cpu/ch04/kv-share-$label.json)
  kill -TERM $pid; wait $pid || true  # the server ends on the signal it was sent
}
run_one "$BASE" before-one-ledger 8741
run_one "$REPO" one-ledger 8742
