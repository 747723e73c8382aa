#!/usr/bin/env bash
# The TTFT tail seen on `default` in the side-by-side rounds, taken apart: the echo server (no model)
# under the benchmark's former client (httpx, `stall_probe.py`), with each of uvicorn's HTTP parsers,
# with keep-alive and without, then under the benchmark's client now (aiohttp,
# `python -m benchmarks.harness.streaming run`); server on core 0, client on core 1, as `--profile cpu` pins
# them. From the repository root:
#   bash benchmarks/studies/stream_stalls/run.sh > benchmarks/studies/stream_stalls/results.txt
set -euo pipefail
here=benchmarks/studies/stream_stalls
port=8191
for http in httptools h11; do
  taskset -c 0 python "$here/echo_stream.py" $port $http & pid=$!
  until curl -sf -X POST "http://127.0.0.1:$port/v1/inference" -d '{}' >/dev/null; do sleep 0.5; done
  for keep in 64 0; do
    echo "== server $http, client keep-alive connections $keep"
    PYTHONPATH=. taskset -c 1 python "$here/stall_probe.py" "http://127.0.0.1:$port" --keep-alive $keep
  done
  echo "== server $http, the benchmark's client (aiohttp, keep-alive)"
  taskset -c 1 python -m benchmarks.harness.streaming run --url "http://127.0.0.1:$port" --users 64 --duration-s 20 --workload default \
    | python -c "import json, sys; d = json.load(sys.stdin); print(json.dumps({'requests_per_s': round(d['qps'], 1), 'ttft_p50_ms': round(d['ttft_ms']['p50']), 'ttft_p99_ms': round(d['ttft_ms']['p99'])}))"
  kill $pid; wait $pid 2>/dev/null || true
done
