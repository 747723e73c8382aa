"""How close the rest of chapter 8's step runs to what this core can do: its linear layers and its GELU.

In process, a packed step is almost all model time; in the model the linear layers come first, the
decode attention second (``kernel-floor/`` beside this: within about a tenth of its reads alone),
and GELU third (``profile-avx2-*`` beside the figures). Two questions, each answered in one process
with its cases taking turns, fp32 (what a machine without native bf16 serves), one thread:

- **the linear layers**: the default model's 16 (4 blocks of ``c_attn``, ``attn.c_proj``, ``c_fc``,
  ``mlp.c_proj``) one after the other, as a step calls them, at a decode step's 64 tokens and a
  step with prompt chunks (160), through ``F.linear`` as served (MKL's sgemm), MKL's packed-weight
  linear (what TorchInductor's freezing swaps in on a CPU), and oneDNN's linear; and a single large
  product (512 x 1024 x 1024) for what this core's sgemm does at its best;
- **GELU** on a step's ``(tokens, 4 * n_embd)`` activations: the model's tanh approximation as
  served, the exact (erf) GELU, and the same tanh approximation written through a sigmoid
  (``tanh(z) = 2 sigmoid(2z) - 1``, so ``0.5 x (1 + tanh z) = x sigmoid(2z)``: equal in exact
  arithmetic, not bit for bit), with its largest difference from the served one; ReLU for scale.

From the repository root, one core, as the servers run:

    PYTHONPATH=. taskset -c 0 python benchmarks/studies/step_floor/floor_study.py \\
        > benchmarks/studies/step_floor/results.txt
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness.environment import cpu_description
from shared.model import PRESETS

ROUNDS, CALLS = 9, 20
GELU_TANH_SCALE = 2 * math.sqrt(2 / math.pi)  # 2z = GELU_TANH_SCALE * (x + 0.044715 x^3)


def timed(cases: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Milliseconds per call of each case: the median of ROUNDS rounds, the cases taking turns in each."""
    for run in cases.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, run in cases.items():
            started = time.perf_counter()
            for _ in range(CALLS):
                run()
            samples[name].append((time.perf_counter() - started) / CALLS * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def gelu_through_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(GELU_TANH_SCALE * (x + 0.044715 * x * x * x))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    d = config.n_embd
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * config.n_layer  # (out, in) as nn.Linear keeps them
    weights = [(torch.randn(out, inp) * 0.02, torch.zeros(out)) for out, inp in shapes]
    print(f"{cpu_description()}, torch {torch.__version__}, one thread, fp32; median of {ROUNDS} interleaved rounds of {CALLS} calls")

    for tokens in (64, 160):
        inputs = {inp: torch.randn(tokens, inp) for inp in (d, 4 * d)}
        flops = sum(2 * tokens * out * inp for out, inp in shapes)
        mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, tokens), w, b) for w, b in weights]

        def served() -> None:
            for w, b in weights:
                F.linear(inputs[w.shape[1]], w, b)

        def mkl_packed() -> None:
            for packed, w, b in mkl:
                torch.ops.mkl._mkl_linear(inputs[w.shape[1]], packed, w, b, tokens)

        def onednn() -> None:
            for w, b in weights:
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], w, b, "none", [], "")

        result = timed({"F.linear (served)": served, "MKL packed weights": mkl_packed, "oneDNN linear": onednn})
        print(f"\nthe model's {len(shapes)} linear layers at {tokens} tokens ({flops / 1e6:.0f} MFLOP):")
        for name, ms in result.items():
            print(f"  {name:<22} {ms:7.3f} ms  {flops / ms / 1e6:6.1f} GFLOP/s  {ms / result['F.linear (served)']:.2f}x served")

    big_a, big_b = torch.randn(512, 1024), torch.randn(1024, 1024)
    ms = timed({"sgemm": lambda: torch.mm(big_a, big_b)})["sgemm"]
    print(f"\none large product (512 x 1024 x 1024), for scale: {ms:.3f} ms, {2 * 512 * 1024 * 1024 / ms / 1e6:.1f} GFLOP/s")

    for tokens in (64, 160):
        x = torch.randn(tokens, 4 * d)
        served_gelu = F.gelu(x, approximate="tanh")
        difference = (gelu_through_sigmoid(x) - served_gelu).abs().max().item()
        result = timed({
            "tanh approximation (served)": lambda: F.gelu(x, approximate="tanh"),
            "exact (erf)": lambda: F.gelu(x),
            "tanh approximation via sigmoid": lambda: gelu_through_sigmoid(x),
            "ReLU": lambda: torch.relu(x),
        })
        print(f"\nGELU on ({tokens}, {4 * d}) activations, one layer's:")
        for name, ms in result.items():
            print(f"  {name:<31} {ms * 1e3:7.1f} us  {ms / result['tanh approximation (served)']:.2f}x served")
        print(f"  via sigmoid: largest difference from the served values {difference:.1e}")


if __name__ == "__main__":
    main()
