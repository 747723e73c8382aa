"""How close the decode kernel runs to the memory floor of what it reads, and what the block layout costs.

The decode attention of a served `mixed` step reads every running sequence's keys and values from
memory (the caches cannot hold them), so its time is set by how fast one core reads them where
they lie. Three questions, each answered in one process with its cases taking turns, on fp32 pools
(what a machine without native bf16 serves):

- the **floor**: the committed kernel against a build of the same source whose arithmetic is taken
  out (every load and prefetch kept, no products, no exponentials): the time of the reads alone;
- the **layout**: each row's blocks scattered at random over the pool (as a busy pool hands them
  out) against the same blocks in order (as if each sequence's blocks were contiguous);
- the **block size**: 16 tokens (chapter 4's, and chapter 8's before this study) against 64 and 128
  (chapter 8's since; vLLM's CPU backend's with its own kernels), scattered; and 128 in order, what a
  pool that kept each sequence's blocks together would add at that size.

With ``--kv bf16`` (what a core with native bf16 serves) it asks the same on bf16 pools, at the served
block of 128, scattered, adding a ``shared-prefix-like`` case (4 prompts of 256 tokens, each row one
of them and 8-64 tokens of its own: rows read the same blocks, which then stay in the core's caches),
and ``--kernel-of REV`` adds ``paged_decode.c`` as of git revision ``REV`` as a third build.
``--heads 9 --kv-heads 3`` asks it in SmolLM2's shape (grouped-query attention: three query heads read
each key/value head) instead of the toy's 4 heads of their own.

Four layers' pools are visited in turn with a 32 MB read between two calls (the weights a step reads
between two attentions), so that no call finds the previous call's rows in the caches, as in a
served step. The machine's contiguous read rate (a sum over 256 MB) is printed for scale. From the
repository root, one core, as the servers run:

    PYTHONPATH=. taskset -c 0 python benchmarks/studies/kernel_floor/floor_study.py \
        > benchmarks/studies/kernel_floor/results.txt
    PYTHONPATH=. taskset -c 0 python benchmarks/studies/kernel_floor/floor_study.py --kv bf16 --kernel-of 9d653ee \
        > benchmarks/studies/kernel_floor/results-bf16.txt
    PYTHONPATH=. taskset -c 0 python benchmarks/studies/kernel_floor/floor_study.py --kv bf16 --kernel-of 9d653ee \
        --heads 9 --kv-heads 3 > benchmarks/studies/kernel_floor/results-bf16-smollm2.txt
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_description
from benchmarks.studies.ch08_shared_prefix.step_split import revision_kernel_source
from chapters.ch08_continuous_batching.fast.attention_kernel import (KERNEL_ARGUMENTS, KERNEL_FLAGS, KERNEL_FUNCTIONS, KERNEL_SOURCE,
                                                                 scores_scratch)

ROWS, HEAD_DIM, LAYERS, POOL_TOKENS, ROUNDS, STEPS = 64, 64, 4, 2458 * 16, 9, 5
WORKLOADS = {"default-like": (20, 155), "mixed-like": (20, 305)}
SHARED = {"shared-prefix-like": (8, 64)}  # each row: one of 4 prompts of SHARED_TOKENS, then these of its own
PREFIXES, SHARED_TOKENS = 4, 256
# The build without arithmetic: the same loads, each only added up.
READS_ONLY = {
    "part[i][p] += query[i][c][0] * first + query[i][c][1] * second;": "part[i][p] += first + second;",
    "const floats e = exp_lanes(lanes_fp32(row + t0) - highest);": "const floats e = lanes_fp32(row + t0) - highest;",
    "output[i][c][0] += weight[i] * first;": "output[i][c][0] += first;",
    "output[i][c][1] += weight[i] * second;": "output[i][c][1] += second;",
}


def build(directory: Path, name: str, source: str, dtype: torch.dtype = torch.float32):
    path = directory / f"{name}.c"
    path.write_text(source)
    target = directory / f"{name}.so"
    subprocess.run(["cc", *KERNEL_FLAGS, "-o", str(target), str(path), "-lm"], check=True)
    function = getattr(ctypes.CDLL(str(target)), KERNEL_FUNCTIONS[dtype])
    function.argtypes, function.restype = KERNEL_ARGUMENTS, None
    return function


def reads_only_source() -> str:
    source = KERNEL_SOURCE.read_text()
    for old, new in READS_ONLY.items():
        assert old in source, f"paged_decode.c changed: {old!r} not found"
        source = source.replace(old, new)
    return source


class Case:
    """64 decode rows over four layers' pools; each row's blocks scattered or in order; with ``shared``
    tokens, row ``r`` starts with prompt ``r % PREFIXES``'s blocks, as prefix caching shares them."""

    def __init__(self, contexts: tuple[int, int], block: int, scattered: bool, seed: int = 0,
                 dtype: torch.dtype = torch.float32, shared: int = 0, heads: int = 4, kv_heads: int = 4) -> None:
        rng = random.Random(seed)
        self.heads, self.kv_heads = heads, kv_heads
        self.lens = [shared + rng.randint(*contexts) for _ in range(ROWS)]
        self.block, blocks = block, POOL_TOKENS // block
        self.width = max(-(-n // block) for n in self.lens)
        free = list(range(blocks))
        if scattered:
            rng.shuffle(free)
        self.tables = torch.zeros(ROWS, self.width, dtype=torch.int32)
        prefixes = [free[i * shared // block:(i + 1) * shared // block] for i in range(PREFIXES)] if shared else []
        at = PREFIXES * shared // block
        for row, n in enumerate(self.lens):
            for column in range(-(-n // block)):
                if column < shared // block:
                    self.tables[row, column] = prefixes[row % PREFIXES][column]
                    continue
                self.tables[row, column] = free[at]
                at += 1
        self.slots = torch.tensor([int(self.tables[r, (n - 1) // block]) * block + (n - 1) % block for r, n in enumerate(self.lens)])
        generator = torch.Generator().manual_seed(seed)
        self.layers = [[(torch.randn(POOL_TOKENS, kv_heads * HEAD_DIM, generator=generator) * 0.5).to(dtype) for _ in range(2)]
                       for _ in range(LAYERS)]
        self.qkv = torch.randn(ROWS, (heads + 2 * kv_heads) * HEAD_DIM, generator=generator)  # as the fused projection leaves them
        self.bytes_read = sum(self.lens) * kv_heads * HEAD_DIM * dtype.itemsize * 2  # keys and values visited


def ms_per_layer(kernel, case: Case, sweep: torch.Tensor) -> float:
    heads, kv_heads = case.heads, case.kv_heads
    out, scratch = torch.zeros(ROWS, heads, HEAD_DIM), scores_scratch(heads, max(case.lens))
    lens, pointer = torch.tensor(case.lens, dtype=torch.int32), case.qkv.data_ptr()
    q_width, kv_width = heads * HEAD_DIM, kv_heads * HEAD_DIM
    total = 0.0
    for _ in range(STEPS):
        for keys, values in case.layers:
            sweep.sum()
            started = time.perf_counter()
            kernel(pointer, pointer + 4 * q_width, pointer + 4 * (q_width + kv_width), q_width + 2 * kv_width, HEAD_DIM,
                   case.slots.data_ptr(), keys.data_ptr(), values.data_ptr(), case.tables.data_ptr(), case.width,
                   lens.data_ptr(), ROWS, heads, kv_heads, HEAD_DIM, case.block, HEAD_DIM ** -0.5, scratch.data_ptr(),
                   out.data_ptr(), q_width)
            total += time.perf_counter() - started
    return total / (STEPS * LAYERS) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", choices=("fp32", "bf16"), default="fp32", help="the pools' dtype")
    parser.add_argument("--kernel-of", metavar="REV", help="also time paged_decode.c as of this git revision")
    parser.add_argument("--heads", type=int, default=4, help="query heads (the toy's 4 by default; SmolLM2's 9)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads, a divisor of --heads (default: as many)")
    args = parser.parse_args(argv)
    shape = {"heads": args.heads, "kv_heads": args.kv_heads or args.heads}
    if shape["heads"] % shape["kv_heads"]:
        parser.error(f"--kv-heads {shape['kv_heads']} does not divide --heads {shape['heads']}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.kv]
    torch.set_num_threads(1)
    big = torch.randn(64 * 2**20)
    big.sum()
    started = time.perf_counter()
    for _ in range(5):
        big.sum()
    contiguous = big.numel() * 4 * 5 / (time.perf_counter() - started) / 1e9
    print(f"{cpu_description()}, torch {torch.__version__}, one thread, {args.kv} pools, {shape['heads']} query heads over "
          f"{shape['kv_heads']} key/value heads of {HEAD_DIM}; median of {ROUNDS} interleaved rounds "
          f"of {STEPS} steps x {LAYERS} layers; contiguous read (sum of 256 MB): {contiguous:.1f} GB/s")
    sweep = torch.randn(8 * 2**20)  # 32 MB
    with tempfile.TemporaryDirectory() as temporary:
        kernels = {"kernel": build(Path(temporary), "kernel", KERNEL_SOURCE.read_text(), dtype),
                   "reads only": build(Path(temporary), "reads_only", reads_only_source(), dtype)}
        if args.kernel_of:
            kernels[args.kernel_of] = build(Path(temporary), "before", revision_kernel_source(args.kernel_of), dtype)
        workloads = {**WORKLOADS, **SHARED} if dtype == torch.bfloat16 else WORKLOADS
        for workload, contexts in workloads.items():
            shared = SHARED_TOKENS if workload in SHARED else 0
            if dtype == torch.float32:
                cases = {"blocks of 16, scattered": Case(contexts, 16, True, **shape), "blocks of 16, in order": Case(contexts, 16, False, **shape),
                         "blocks of 64, scattered": Case(contexts, 64, True, **shape), "blocks of 128, scattered": Case(contexts, 128, True, **shape),
                         "blocks of 128, in order": Case(contexts, 128, False, **shape)}
            else:
                cases = {"blocks of 128, scattered": Case(contexts, 128, True, dtype=dtype, shared=shared, **shape)}
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(ROUNDS):
                for case_name, case in cases.items():
                    for kernel_name, kernel in kernels.items():
                        times.setdefault((case_name, kernel_name), []).append(ms_per_layer(kernel, case, sweep))
            first = next(iter(cases.values()))
            print(f"{workload}: contexts {shared + contexts[0]}-{shared + contexts[1]} (median {statistics.median(first.lens):.0f}), "
                  f"{first.bytes_read / 2**20:.1f} MiB of keys and values visited per layer")
            reference_name = next(iter(cases))
            reference = statistics.median(times[reference_name, "kernel"])
            for (case_name, kernel_name), values in times.items():
                median = statistics.median(values)
                print(f"  {case_name:24s} {kernel_name:10s} {median:6.3f} ms/layer  {cases[case_name].bytes_read / median / 1e6:5.1f} GB/s"
                      f"  {median / reference:.2f}x the kernel on {reference_name}")


if __name__ == "__main__":
    main()
