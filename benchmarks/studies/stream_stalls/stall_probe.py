"""Where a streamed request's first token waits: the benchmark's former client (httpx, one pool of a
connection per user, 64 users, the ``default`` workload's bodies), each request also recording when the
server entered its handler (``entered`` in the echo server's ``done`` event; ``?`` from any other server).

``python stall_probe.py URL [--keep-alive N] [--duration-s S]`` prints the requests per second, the
TTFT median and P99, and the slowest requests' TTFT and how much of it passed before the server's
handler was entered (``before handler``). Run from the repository root (``PYTHONPATH=.``).
"""

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from benchmarks.harness.streaming import WORKLOADS


async def one(client: httpx.AsyncClient, body: dict) -> tuple[float, float, float | None]:
    sent, first, entered = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/inference", json={**body, "stream": True}) as response:
        event = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "token" and first is None:
                    first = time.perf_counter()
                elif event == "done":
                    entered = json.loads(line[6:]).get("entered")
    return sent, (first or time.perf_counter()) - sent, None if entered is None else entered - sent


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--keep-alive", type=int, default=None, help="idle connections kept (default: one per user)")
    args = parser.parse_args()
    limits = httpx.Limits(max_connections=args.users, max_keepalive_connections=args.users if args.keep_alive is None else args.keep_alive)
    records: list[tuple[float, float, float | None]] = []
    started = time.perf_counter()
    stop_at = started + args.duration_s
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=120) as client:
        async def user(index: int) -> None:
            rng = random.Random(index)
            while time.perf_counter() < stop_at:
                records.append(await one(client, WORKLOADS["default"](rng)))
        await asyncio.gather(*(user(i) for i in range(args.users)))
    ttfts = sorted(r[1] for r in records)
    print(json.dumps({"requests_per_s": round(len(records) / args.duration_s, 1), "ttft_p50_ms": round(statistics.median(ttfts) * 1e3),
                      "ttft_p99_ms": round(ttfts[int(0.99 * (len(ttfts) - 1))] * 1e3)}))
    for sent, ttft, before in sorted(records, key=lambda r: -r[1])[:5]:
        print(f"  sent at {sent - started:6.2f} s: TTFT {ttft * 1e3:6.0f} ms, before handler "
              f"{'?' if before is None else f'{before * 1e3:.0f} ms'}")


if __name__ == "__main__":
    asyncio.run(main())
