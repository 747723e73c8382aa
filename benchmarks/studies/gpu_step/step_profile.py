"""Where a chapter 8 decode step's time goes on a GPU: launches or kernels, eager or recorded.

Builds what chapter 8's server builds on CUDA (the gpu profile's GPT-2 shape, chapter 5's eager engine at
``--precision``, a paged pool in the engine's dtype, ``flex`` attention and ``gather``, the decode steps
recorded per bucket) and times one packed decode step of ``--rows`` rows whose histories spread over
``--contexts`` positions, three ways: eager through ``gather``, eager through ``flex``, and replayed
from a CUDA graph. For each: the wall time of a step waited for (``torch.cuda.synchronize``), the time
Python takes to issue it (until the call returns), and the GPU's own time (CUDA events). Then
torch.profiler's count of kernels per step and its busiest kernels, eager flex against replayed.

    python -m benchmarks.studies.gpu_step.step_profile --out benchmarks/studies/gpu_step/results.txt
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager
from chapters.ch08_continuous_batching.fast.attention_choice import build_attention, scattered_decode_inputs
from chapters.ch08_continuous_batching.fast.cuda_graphs import GraphedDecodes
from chapters.ch08_continuous_batching.model_runner import packed_model
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ScheduledRow
from shared.devices import processor_name, synchronize
from shared.weights import load_model


def timed(step, repeats: int, device: torch.device) -> dict[str, float]:
    """Median wall, issue and GPU (CUDA events; NaN on a CPU) milliseconds of ``step`` over ``repeats`` calls,
    after three unmeasured."""
    for _ in range(3):
        step()
    synchronize(device)
    wall, issue, gpu = [], [], []
    for _ in range(repeats):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.type == "cuda" else []
        began = time.perf_counter()
        events and events[0].record()
        step()
        issued = time.perf_counter()
        events and events[1].record()
        synchronize(device)
        wall.append((time.perf_counter() - began) * 1e3)
        issue.append((issued - began) * 1e3)
        gpu.append(events[0].elapsed_time(events[1]) if events else float("nan"))
    return {"wall": statistics.median(wall), "issue": statistics.median(issue), "gpu": statistics.median(gpu)}


def kernel_summary(step, label: str, top: int, device: torch.device) -> str:
    """torch.profiler over five calls of ``step``: kernels per step and the busiest ``top`` kernels."""
    from torch.profiler import ProfilerActivity, profile

    step()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            step()
        synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60)
    return f"{label}: {len(kernels) / 5:.0f} GPU events per step\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs=2, default=[32, 160], help="shortest and longest history")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run on the tiny model, the steps not recorded")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    loaded = load_model("smollm2", device=device) if device.type == "cuda" else load_model("default", "tiny", device)
    engine = build_eager(loaded.model, args.precision)
    model = packed_model(engine)
    largest = max(args.rows)
    blocks = largest * -(-args.contexts[1] // args.block_tokens) + 1  # every row's longest history, and the scratch block
    store = PagedKVStore(KVMemoryPool(loaded.config, blocks * args.block_tokens, block_tokens=args.block_tokens,
                                      device=device, dtype=engine.dtype))
    backends = {name: build_attention(name, store) for name in ("gather", "flex")}
    started = time.perf_counter()
    graphs = GraphedDecodes(model, store, backends["flex"], largest, capture=device.type == "cuda")
    lines = [f"{processor_name(device)}, torch {torch.__version__}, {loaded.source}, {args.precision}, "
             f"blocks of {args.block_tokens}; histories {args.contexts[0]}-{args.contexts[1]} positions; "
             f"medians of {args.repeats} steps; graphs for {graphs.buckets} rows recorded in {time.perf_counter() - started:.1f} s",
             "", f"{'rows':>5} {'path':<16} {'wall ms':>8} {'issue ms':>9} {'GPU ms':>7} {'tokens/s':>10}"]
    rng = random.Random(0)
    profiles = []
    for rows in args.rows:
        contexts = [args.contexts[0] + (args.contexts[1] - args.contexts[0]) * i // max(1, rows - 1) for i in range(rows)]
        inputs, seqs = scattered_decode_inputs(store, contexts, rng)
        scheduled = [ScheduledRow(seq, len(seq.token_ids) - 1, 1) for seq in seqs]

        def eager(backend):
            return lambda: model.forward_packed(inputs.input_ids, inputs.positions, backend.bind(inputs), inputs.logits_indices)

        def replayed():
            graphs.run(graphs.prepare(scheduled), rows)

        paths = {"eager gather": eager(backends["gather"]), "eager flex": eager(backends["flex"]), "recorded flex": replayed}
        for label, step in paths.items():
            t = timed(step, args.repeats, device)
            lines.append(f"{rows:>5} {label:<16} {t['wall']:>8.2f} {t['issue']:>9.2f} {t['gpu']:>7.2f} {rows / t['wall'] * 1e3:>10.0f}")
        if rows == largest:
            profiles = [kernel_summary(paths["eager flex"], f"eager flex, {rows} rows", 12, device),
                        kernel_summary(paths["recorded flex"], f"recorded flex, {rows} rows", 12, device)]
        for seq in seqs:
            store.manager.free(seq.seq_id)
    text = "\n".join(lines + [""] + profiles)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
