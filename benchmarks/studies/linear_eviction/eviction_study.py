"""Chapter 8's linear layers with their weights warm, as a microbenchmark has them, and cold, as a served step has them.

Inside a served `mixed` step, between two uses of a weight (one step apart) every layer's decode
attention has streamed every running sequence's keys and values through the caches: tens of MB, more
than the caches hold. Here the model's sixteen linear layers run at one step's token count, timed
call by call, each call either right after the previous one (warm) or right after reading a buffer of
that size (cold). Two ways to multiply: aten's ``linear`` (what the engine calls) and MKL's pre-packed
weights (what TorchInductor's freezing uses for fp32 on a CPU). Prints the median over interleaved
rounds of the milliseconds a step's linear layers take, per case. From the repository root, one core,
as the servers run:

    PYTHONPATH=. taskset -c 0 python benchmarks/studies/linear_eviction/eviction_study.py \
        > benchmarks/studies/linear_eviction/results.txt
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.harness.environment import cpu_description
from shared.weights import load_model

TOKENS, SWEEP_MB, ROUNDS, STEPS = 95, 64, 7, 20


def main() -> None:
    torch.set_num_threads(1)
    model = load_model("default", device="cpu").model
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    inputs = [torch.randn(TOKENS, layer.in_features) for layer in layers]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(layer.weight, TOKENS) for layer in layers]
    sweep = torch.randn(SWEEP_MB * 2**20 // 4)
    ways = {
        "aten linear": lambda i: F.linear(inputs[i], layers[i].weight, layers[i].bias),
        "mkl packed": lambda i: torch.ops.mkl._mkl_linear(inputs[i], packed[i], layers[i].weight, layers[i].bias, TOKENS),
    }

    def step_ms(way, swept: bool) -> float:
        total = 0.0
        for _ in range(STEPS):
            for index in range(len(layers)):
                if swept:
                    sweep.sum()
                started = time.perf_counter()
                way(index)
                total += time.perf_counter() - started
        return total / STEPS * 1e3

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(ROUNDS):  # interleaved: a shared machine's drift hits every case alike
        for name, way in ways.items():
            for swept in (False, True):
                times.setdefault((name, "cold" if swept else "warm"), []).append(step_ms(way, swept))
    print(f"{cpu_description()}, torch {torch.__version__}, one thread; {len(layers)} linear layers at {TOKENS} tokens, "
          f"cold: a {SWEEP_MB} MB sweep before each call; median of {ROUNDS} interleaved rounds of {STEPS} steps")
    for name in ways:
        warm, cold = (statistics.median(times[name, case]) for case in ("warm", "cold"))
        print(f"{name}: warm {warm:.2f} ms a step, cold {cold:.2f} ms a step ({cold / warm:.2f}x)")


if __name__ == "__main__":
    main()
