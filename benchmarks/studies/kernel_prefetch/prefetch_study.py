"""The decode kernel with and without its prefetch (``AHEAD`` in ``paged_decode.c``), side by side.

Both builds are the committed source with the chapter's flags, one of them with ``-DAHEAD=0``; they
take turns on the same inputs, round after round: 64 decode rows over a bf16 pool of 2458 blocks of
16 tokens, each row's blocks scattered at random (as a busy pool scatters them), 4 heads of 64,
contexts drawn uniformly from the range given. The outputs and the written keys must be bit-equal.
From the repository root, one core, as the servers run:

    PYTHONPATH=. taskset -c 0 python benchmarks/studies/kernel_prefetch/prefetch_study.py \
        > benchmarks/studies/kernel_prefetch/results.txt

Where the build without it spends its time, instruction by instruction, on a machine whose ``perf`` has
counters (``--build-dir`` keeps the two builds so that perf can read their code):

    PYTHONPATH=. perf record -o /tmp/prefetch.data python benchmarks/studies/kernel_prefetch/prefetch_study.py --build-dir /tmp/prefetch
    perf annotate -i /tmp/prefetch.data --stdio -d off.so -s paged_decode_bf16 | awk '$1 + 0 >= 1' \
        > benchmarks/studies/kernel_prefetch/perf-annotate-without.txt
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
from chapters.ch08_continuous_batching.fast.attention_kernel import KERNEL_ARGUMENTS, KERNEL_FLAGS, KERNEL_SOURCE, scores_scratch

ROWS, HEADS, HEAD_DIM, BLOCK, POOL_BLOCKS, ROUNDS, CALLS = 64, 4, 64, 16, 2458, 15, 20
WORKLOADS = {"default-like": (20, 155), "mixed-like": (20, 305)}


def build(directory: Path, name: str, *extra: str):
    target = directory / f"{name}.so"
    subprocess.run(["cc", *KERNEL_FLAGS, *extra, "-o", str(target), str(KERNEL_SOURCE), "-lm"], check=True)
    function = ctypes.CDLL(str(target)).paged_decode_bf16
    function.argtypes, function.restype = KERNEL_ARGUMENTS, None
    return function


def inputs(contexts: tuple[int, int], seed: int = 0):
    rng = random.Random(seed)
    lens = [rng.randint(*contexts) for _ in range(ROWS)]
    width = max(-(-n // BLOCK) for n in lens)
    free = list(range(POOL_BLOCKS))
    rng.shuffle(free)
    tables = torch.zeros(ROWS, width, dtype=torch.int32)
    for row, n in enumerate(lens):
        for column in range(-(-n // BLOCK)):
            tables[row, column] = free.pop()
    slots = torch.tensor([int(tables[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for r, n in enumerate(lens)])
    generator = torch.Generator().manual_seed(seed)
    planes = [(torch.randn(POOL_BLOCKS * BLOCK, HEADS * HEAD_DIM, generator=generator) * 0.5).to(torch.bfloat16) for _ in range(2)]
    qkv = torch.randn(ROWS, 3 * HEADS * HEAD_DIM, generator=generator)  # c_attn's output: q, k, v side by side
    return lens, width, tables, slots, planes, qkv


def timed(kernel, case) -> tuple[float, torch.Tensor, torch.Tensor]:
    lens, width, tables, slots, planes, qkv = case
    keys, values = planes[0].clone(), planes[1].clone()
    out, scratch, lens_tensor = torch.zeros(ROWS, HEADS, HEAD_DIM), scores_scratch(HEADS, max(lens)), torch.tensor(lens, dtype=torch.int32)
    stride = HEADS * HEAD_DIM

    def call() -> None:
        kernel(qkv.data_ptr(), qkv.data_ptr() + 4 * stride, qkv.data_ptr() + 8 * stride, 3 * stride, HEAD_DIM,
               slots.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(), width, lens_tensor.data_ptr(),
               ROWS, HEADS, HEADS, HEAD_DIM, BLOCK, HEAD_DIM ** -0.5, scratch.data_ptr(), out.data_ptr(), stride)

    call()
    started = time.perf_counter()
    for _ in range(CALLS):
        call()
    return (time.perf_counter() - started) / CALLS * 1e3, out, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, default=None, help="build here and keep the builds (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{cpu_description()}, torch {torch.__version__}, {ROUNDS} interleaved rounds of {CALLS} calls")
    with tempfile.TemporaryDirectory() as temporary:
        directory = args.build_dir or Path(temporary)
        directory.mkdir(parents=True, exist_ok=True)
        kernels = {"without prefetch": build(directory, "off", "-DAHEAD=0"), "with prefetch": build(directory, "on")}
        for workload, contexts in WORKLOADS.items():
            case = inputs(contexts)
            ms: dict[str, list[float]] = {name: [] for name in kernels}
            results = {}
            for _ in range(ROUNDS):
                for name, kernel in kernels.items():
                    elapsed, out, keys = timed(kernel, case)
                    ms[name].append(elapsed)
                    results[name] = (out, keys)
            (out_a, keys_a), (out_b, keys_b) = results.values()
            assert torch.equal(out_a, out_b) and torch.equal(keys_a, keys_b), "the prefetch changed a result"
            medians = {name: statistics.median(values) for name, values in ms.items()}
            print(f"{workload} (contexts {contexts[0]}-{contexts[1]}, median {statistics.median(case[0]):.0f}): "
                  + ", ".join(f"{name} {value:.3f} ms/layer" for name, value in medians.items())
                  + f"; with / without {medians['with prefetch'] / medians['without prefetch']:.2f}; outputs bit-equal")


if __name__ == "__main__":
    main()
