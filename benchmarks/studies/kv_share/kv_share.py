"""How much of chapter 4's KV pool is reserved under load, and how much of what is reserved gets written.

``python -m benchmarks.studies.kv_share.kv_share --url http://127.0.0.1:8000 --users 64 --seconds 20 --out FILE``
loads a running chapter 4-7 server with the harness's default workload (closed loop, ``--users``
clients) and samples ``/stats`` every 0.2 s. Two figures, per sample, averaged over the run:

- **reserved share**: the share of the pool's blocks reserved at that moment;
- **written share**: of the slots reserved, the share that real tokens' keys and values fill
  (prompt + new tokens - 1 per request: the last token is never fed back).

It reads both ``/stats`` layouts: the current one (one ledger: ``pool.blocks_used`` is what the
running batch reserved, ``pool.slots_written_total / slots_reserved_total`` what it wrote) and the
one before it (``admission.reserved_blocks``: every admitted request reserved ``n_ctx`` positions;
the written share is then computed from the requests the client has in flight, all of which were
admitted while no request waited). The JSON it writes records both, the layout, and the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.harness.results import print_and_save
from benchmarks.harness.workload import DEFAULT_SEED, PromptStream, get_workload


class InFlight:
    """The slots each request the client has in flight will write: prompt + new tokens - 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, int] = {}

    def add(self, key: int, slots: int) -> None:
        with self._lock:
            self._slots[key] = slots

    def remove(self, key: int) -> None:
        with self._lock:
            self._slots.pop(key, None)

    def total(self) -> tuple[int, int]:
        with self._lock:
            return len(self._slots), sum(self._slots.values())


def sample(stats: dict, in_flight: InFlight) -> dict | None:
    """One sample's reserved and written shares, or None when nothing is reserved at that moment."""
    pool, admission = stats["pool"], stats.get("admission", {})
    if "reserved_blocks" in admission:  # the layout before one ledger: reservations per request
        reserved_blocks = admission["reserved_blocks"]
        if not reserved_blocks or admission.get("waiting"):
            return None
        _count, written = in_flight.total()
        reserved_slots = reserved_blocks * pool["block_tokens"]
        return {"reserved_share": reserved_blocks / admission["capacity_blocks"], "written_share": written / reserved_slots}
    if not pool["blocks_used"]:
        return None
    return {"reserved_share": pool["blocks_used"] / pool["blocks_total"], "written_share": None}


def run(url: str, users: int, seconds: float) -> dict:
    workload = get_workload("default")
    in_flight, stop = InFlight(), threading.Event()
    samples: list[dict] = []
    answered = [0]

    def client(index: int) -> None:
        stream, session, n = PromptStream(workload, DEFAULT_SEED, index), requests.Session(), 0
        while not stop.is_set():
            body = stream.next_body()
            key = index * 1_000_000 + n
            n += 1
            in_flight.add(key, len(body["input_ids"]) + body["max_new_tokens"] - 1)
            try:
                if session.post(f"{url}/v1/inference", json=body, timeout=120).status_code == 200:
                    answered[0] += 1
            finally:
                in_flight.remove(key)

    with ThreadPoolExecutor(users) as pool:
        for index in range(users):
            pool.submit(client, index)
        time.sleep(2.0)  # let every client have a request in flight before sampling
        start = before = requests.get(f"{url}/stats", timeout=10).json()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            point = sample(requests.get(f"{url}/stats", timeout=10).json(), in_flight)
            if point is not None:
                samples.append(point)
            time.sleep(0.2)
        after = requests.get(f"{url}/stats", timeout=10).json()
        stop.set()
    result = {
        "url": url, "users": users, "seconds": seconds, "samples": len(samples), "answered": answered[0],
        "layout": "per-request reservations" if "reserved_blocks" in start.get("admission", {}) else "one ledger",
        "reserved_share_mean": statistics.fmean(s["reserved_share"] for s in samples) if samples else None,
    }
    written = [s["written_share"] for s in samples if s["written_share"] is not None]
    if written:
        result["written_share_mean"] = statistics.fmean(written)
    else:  # one ledger: the server counts slots reserved and written, batch by batch
        reserved = after["pool"]["slots_reserved_total"] - before["pool"]["slots_reserved_total"]
        wrote = after["pool"]["slots_written_total"] - before["pool"]["slots_written_total"]
        result["written_share_mean"] = wrote / reserved if reserved else None
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.kv_share.kv_share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="a running server on loopback")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--label", default="", help="what was measured (kept in the JSON)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.", "http://localhost")):
        parser.error("load only a server on loopback")
    result = {"label": args.label, **run(args.url, args.users, args.seconds),
              "reproduce": "python -m benchmarks.studies.kv_share.kv_share " + " ".join(sys.argv[1:] if argv is None else argv)}
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
