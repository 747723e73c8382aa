"""Leak hunting, the article's method: send many requests, a share of them failing, and watch memory per request.

Serves chapter 7 in-process (an ASGI transport), sends ``--requests`` requests of which ``--fail-share`` fail past a
deadline (504), and reports memory growth per 1,000 requests after a warm-up (live tensors, the Python heap, the device;
RSS reported, not judged); above ``--threshold-mb`` it is a leak. ``--leak-lesson leaky`` releases a per-request tensor
on the success path only, ``fixed`` in ``finally``, ``off`` has none. Exit status 1 on a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import sys
import tracemalloc
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from chapters.ch07_production.deadlines import TIMEOUT_HEADER
from chapters.ch07_production.server import ProductionSettings, build_app
from shared.devices import memory_snapshot


@dataclass(frozen=True)
class LeakReport:
    leak_lesson: str
    requests: int
    failed: int
    statuses: dict[str, int]
    rss_growth_mb_per_1000: float
    device_growth_mb_per_1000: float | None
    python_heap_growth_mb_per_1000: float
    live_tensor_growth_mb_per_1000: float
    threshold_mb: float
    # memory after the warm-up, then after each further share of the requests: requests and failed so far, figures in MiB
    series: tuple[dict, ...] = ()

    @property
    def leaking(self) -> bool:
        """Judged on what the garbage collector can reach (tensors, Python objects) and the device, not on RSS: the C
        allocator keeps freed pages, so a short run's RSS moves without a leak."""
        grown = max(self.live_tensor_growth_mb_per_1000, self.device_growth_mb_per_1000 or 0.0, self.python_heap_growth_mb_per_1000)
        return grown > self.threshold_mb


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage the garbage collector can reach (each storage counted once)."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on some deprecated torch module attributes warns,
        warnings.simplefilter("ignore", FutureWarning)  # and so does a fake tensor's data pointer
        warnings.simplefilter("ignore", UserWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                try:
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError):
                    continue  # a fake or functional tensor (left by a compiler's tracing) holds no memory
    return sum(storages.values())


def _memory(device) -> tuple[int, int | None, int, int]:
    gc.collect()
    figures = memory_snapshot(device)
    return (figures["process_rss_bytes"], figures.get("cuda_allocated_bytes"), tracemalloc.get_traced_memory()[0],
            live_tensor_bytes())


def _sample(sent: int, failed: int, figures: tuple[int, int | None, int, int]) -> dict:
    rss, device_bytes, heap, tensors = figures
    return {"requests": sent, "failed": failed, "rss_mb": round(rss / 2**20, 3),
            "device_mb": round(device_bytes / 2**20, 3) if device_bytes is not None else None,
            "python_heap_mb": round(heap / 2**20, 3), "live_tensor_mb": round(tensors / 2**20, 3)}


async def run_leakcheck(leak_lesson: str = "fixed", requests: int = 2000, fail_share: float = 0.2, warmup: int = 200,
                        concurrency: int = 8, threshold_mb: float = 8.0, seed: int = 0, device: str = "cpu",
                        samples: int = 1) -> LeakReport:
    """Serve, warm up, measure, send ``requests`` more in ``samples`` equal shares, measuring after each
    (``LeakReport.series``): the growth per 1,000 requests, the last measurement against the first."""
    if not 0.0 <= fail_share <= 1.0:
        raise ValueError(f"fail_share must be within [0, 1], got {fail_share}")
    if not 1 <= samples <= max(1, requests):
        raise ValueError(f"samples must be within [1, requests={requests}], got {samples}")
    settings = ProductionSettings(
        weights="default", device=device, engine="eager", precision="fp32", tuned_config="none",
        leak_lesson=leak_lesson, fallback_slots=0, max_queue=10_000, pool_tokens=8 * 512, probe_interval_s=3600,
    )
    app = build_app(settings)
    model_device = app.state.production.staging_device
    rng = random.Random(seed)
    statuses: dict[str, int] = {}

    async def one(client: httpx.AsyncClient) -> None:
        failing = rng.random() < fail_share
        headers = {TIMEOUT_HEADER: "0.000001"} if failing else {}
        prompt = [rng.randrange(1, 250) for _ in range(rng.choice((8, 16, 32)))]
        response = await client.post("/v1/inference", json={"input_ids": prompt, "max_new_tokens": 2}, headers=headers)
        statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1

    async def send(client: httpx.AsyncClient, n: int) -> None:
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded() -> None:
            async with semaphore:
                await one(client)

        await asyncio.gather(*(bounded() for _ in range(n)))

    tracemalloc.start()
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://leakcheck", timeout=120) as client:
                await send(client, warmup)
                statuses.clear()
                before = _memory(model_device)
                series = [_sample(0, 0, before)]
                sent = 0
                for share in range(1, samples + 1):
                    batch = requests * share // samples - sent
                    await send(client, batch)
                    sent += batch
                    after = _memory(model_device)
                    series.append(_sample(sent, sum(n for status, n in statuses.items() if status != "200"), after))
    finally:
        tracemalloc.stop()
    per_1000 = 1000 / max(1, requests) / 2**20
    return LeakReport(
        leak_lesson=leak_lesson, requests=requests,
        failed=sum(count for status, count in statuses.items() if status != "200"), statuses=statuses,
        rss_growth_mb_per_1000=round((after[0] - before[0]) * per_1000, 3),
        device_growth_mb_per_1000=round((after[1] - before[1]) * per_1000, 3) if after[1] is not None else None,
        python_heap_growth_mb_per_1000=round((after[2] - before[2]) * per_1000, 3),
        live_tensor_growth_mb_per_1000=round((after[3] - before[3]) * per_1000, 3),
        threshold_mb=threshold_mb, series=tuple(series),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chapters.ch07_production.leakcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--fail-share", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threshold-mb", type=float, default=8.0, help="growth per 1,000 requests flagged as a leak")
    parser.add_argument("--leak-lesson", choices=("off", "leaky", "fixed"), default="fixed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=1, help="measure memory after each 1/N of the requests (the curve)")
    parser.add_argument("--out", type=Path, default=None, help="write the report (with the curve) to this JSON file")
    args = parser.parse_args(argv)
    if not 1 <= args.samples <= max(1, args.requests):
        parser.error(f"--samples must be within [1, --requests], got {args.samples}")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("chapters.ch07_production.requests").setLevel(logging.WARNING)  # no line per request here
    report = asyncio.run(run_leakcheck(args.leak_lesson, args.requests, args.fail_share, args.warmup,
                                       args.concurrency, args.threshold_mb, device=args.device, samples=args.samples))
    document = {**asdict(report), "leaking": report.leaking}
    print(json.dumps(document, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {"fail_share": args.fail_share, "warmup": args.warmup, "concurrency": args.concurrency,
                  "device": args.device, "command": " ".join(["python -m chapters.ch07_production.leakcheck",
                                                              *(argv if argv is not None else sys.argv[1:])])}
        args.out.write_text(json.dumps({**document, **config}, indent=2) + "\n")
    return 1 if report.leaking else 0


if __name__ == "__main__":
    sys.exit(main())
