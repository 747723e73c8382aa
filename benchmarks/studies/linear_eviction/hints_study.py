"""Can the attention kernel's reads leave the weights in the caches? Two hints, measured in a step's order.

`eviction_study.py` beside this file shows the linear layers slower cold than warm. Here a step is
played as a served one orders it: for each of four layers, that layer's four linear layers at one
step's token count, then the decode kernel over that layer's fp32 pool (64 rows, `mixed`-like
contexts, blocks of 128 scattered, as chapter 8 serves them). Each case times the linear layers and
the kernel separately, in interleaved rounds:

- ``as committed``: the kernel as chapter 8 builds it (it asks for each row AHEAD positions on, for
  every level of cache: locality 3);
- ``non-temporal prefetch``: the same source asking with the non-temporal hint (locality 0 for
  ``__builtin_prefetch``, ``prefetchnta`` on x86), which tells the CPU the rows will not be read
  again soon, so that they need not displace the weights;
- ``no prefetch``: built with ``-DAHEAD=0`` (only the CPU's own prefetcher);
- ``weights read first``: the committed kernel, and each layer's weights read once in order (a sum)
  just before its linear layers, so that they arrive as one stream instead of as the matrix product
  asks for them; the read is counted in the linear layers' time;
- ``warm``: the linear layers with no kernel between them (the floor for the linear layers).

From the repository root, one core, as the servers run:

    PYTHONPATH=. taskset -c 0 python benchmarks/studies/linear_eviction/hints_study.py \\
        > benchmarks/studies/linear_eviction/hints-results.txt
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_description
from chapters.ch08_continuous_batching.fast.attention_kernel import KERNEL_SOURCE, scores_scratch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernel_floor"))
from floor_study import HEAD_DIM, HEADS, ROWS, Case, build  # noqa: E402  (the floor study's pools and build)

TOKENS, ROUNDS, STEPS = 79, 20, 6  # 79: the median tokens of a `mixed` step at 64 sequences (the step profile)
PREFETCH_CALL = "__builtin_prefetch((const char *)row + at, 0, 3)"  # the committed request


def skip_kernel(*arguments) -> None:
    pass


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    width = HEADS * HEAD_DIM
    layers = [[torch.nn.Linear(a, b) for a, b in ((width, 3 * width), (width, width), (width, 4 * width), (4 * width, width))]
              for _ in range(4)]
    x, hidden = torch.randn(TOKENS, width, generator=generator), torch.randn(TOKENS, 4 * width, generator=generator)
    case = Case((20, 305), 128, scattered=True)
    out, scratch = torch.zeros(ROWS, HEADS, HEAD_DIM), scores_scratch(HEADS, max(case.lens))
    lens, pointer = torch.tensor(case.lens, dtype=torch.int32), case.qkv.data_ptr()

    def step(kernel, read_weights_first: bool) -> tuple[float, float]:
        linear_s = kernel_s = 0.0
        for linears, (keys, values) in zip(layers, case.layers):
            started = time.perf_counter()
            with torch.no_grad():
                if read_weights_first:
                    for linear in linears:
                        linear.weight.sum()
                linears[0](x), linears[1](x), linears[2](x), linears[3](hidden)
            between = time.perf_counter()
            kernel(pointer, pointer + 4 * width, pointer + 8 * width, 3 * width, HEAD_DIM, case.slots.data_ptr(),
                   keys.data_ptr(), values.data_ptr(), case.tables.data_ptr(), case.width, lens.data_ptr(),
                   ROWS, HEADS, HEADS, HEAD_DIM, case.block, HEAD_DIM ** -0.5, scratch.data_ptr(), out.data_ptr(), width)
            linear_s, kernel_s = linear_s + between - started, kernel_s + time.perf_counter() - between
        return linear_s * 1e3, kernel_s * 1e3

    source = KERNEL_SOURCE.read_text()
    assert PREFETCH_CALL in source, f"paged_decode.c changed: {PREFETCH_CALL!r} not found"
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        committed = build(directory, "committed", source)
        cases = {
            "as committed": (committed, False),
            "non-temporal prefetch": (build(directory, "nta", source.replace(PREFETCH_CALL, PREFETCH_CALL.replace("0, 3)", "0, 0)"))), False),
            "no prefetch": (build(directory, "no_prefetch", source.replace("#define AHEAD 8", "#define AHEAD 0")), False),
            "weights read first": (committed, True),
            "warm": (skip_kernel, False),
        }
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
        names = list(cases)
        for round_ in range(ROUNDS):
            # Each round starts with the next case: a case's place in a round moves its time by a few per cent.
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                kernel, read_first = cases[name]
                steps = [step(kernel, read_first) for _ in range(STEPS)][1:]  # the first visits a cold pool
                times[name][0].append(statistics.median(linear for linear, _ in steps))
                times[name][1].append(statistics.median(attention for _, attention in steps))
    print(f"{cpu_description()}, torch {torch.__version__}, one thread; a step of 4 layers at {TOKENS} tokens, the kernel over "
          f"{ROWS} rows of contexts 20-305 (median {statistics.median(case.lens):.0f}), fp32, blocks of 128 scattered; "
          f"median of {ROUNDS} interleaved rounds of {STEPS - 1} steps each, the cases' order rotating")
    committed_both = [linear + attention for linear, attention in zip(*times["as committed"])]
    committed_linear = times["as committed"][0]
    for name, (linear, attention) in times.items():
        both = [a + b for a, b in zip(linear, attention)]
        # Each round's ratio to the committed kernel in the same round: the machine's speed drifts between rounds.
        ratio = statistics.median(b / c for b, c in zip(both, committed_both))
        linear_ratio = statistics.median(a / c for a, c in zip(linear, committed_linear))
        print(f"  {name:22s} linear layers {statistics.median(linear):6.2f} ms/step ({linear_ratio:.2f}x)  "
              f"kernel {statistics.median(attention):6.2f} ms/step  both {statistics.median(both):6.2f} ms/step ({ratio:.2f}x)")
    print("(in brackets: the median over rounds of each round's ratio to `as committed` in that round)")


if __name__ == "__main__":
    main()
