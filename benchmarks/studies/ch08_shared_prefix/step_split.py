"""Where a decode step of 64 rows spends its time beyond its matrix products, measured in place.

One pure decode step of chapter 8's engine (64 rows, the default workload, ``ch08_step_profile``'s
closed loop) is captured and replayed, in process and on one thread, in turns with variants of
itself: attention that returns its queries (no cache read), GELU as the identity, both, GELU
computed in other ways (the same tanh approximation through a sigmoid, in place; the exact erf
GELU, another function, for scale), and the model's linear layers alone on 64 rows. Replaying
writes the same slots again, which changes no timing. The differences split the step:

    python -m benchmarks.studies.ch08_shared_prefix.step_split --attention kernel > benchmarks/studies/ch08_shared_prefix/step-split-kernel.txt
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import shared.model
from benchmarks.harness.environment import cpu_description
from benchmarks.studies.ch08_shared_prefix.step_vs_products import ROWS, products
from benchmarks.studies.ch08_step_profile.profile_ch08 import closed_loop

ROUNDS, CALLS = 15, 20


def gelu_through_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """tanh(z) = 2·sigmoid(2z) − 1: the served function, in one buffer written in place."""
    inner = torch.addcmul(x, x * x, x, value=0.044715)
    return inner.mul_(2 * math.sqrt(2 / math.pi)).sigmoid_().mul_(x)


GELUS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "served": lambda x: F.gelu(x, approximate="tanh"),
    "identity": lambda x: x,
    "via sigmoid, in place": gelu_through_sigmoid,
    "exact (erf)": F.gelu,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="kernel", choices=("gather", "flex", "kernel"))
    args = parser.parse_args(argv)
    loop = closed_loop(args.attention, "fp32", "default")
    model = loop.engine.runner.model
    captured: list[tuple] = []
    forward = model.forward_packed

    def capture(input_ids, positions, attend, logits_indices):  # noqa: ANN001, ANN202
        if input_ids.numel() == ROWS and not captured:
            captured.append((input_ids, positions, attend, logits_indices))
        return forward(input_ids, positions, attend, logits_indices)

    model.forward_packed = capture
    while not captured:
        loop.turn(1)
    model.forward_packed = forward
    input_ids, positions, attend, logits_indices = captured[0]
    no_attention = lambda layer, q, k, v: q  # noqa: E731
    variants = {f"step, GELU {name}": (attend, gelu) for name, gelu in GELUS.items()}
    variants |= {"step, attention skipped": (no_attention, GELUS["served"]),
                 "step, attention skipped, GELU identity": (no_attention, GELUS["identity"])}
    run_products, gflop = products(torch.float32)
    served_mlp = shared.model.MLP.forward
    times: dict[str, list[float]] = {name: [] for name in [*variants, "matrix products alone"]}
    try:
        with torch.no_grad():
            for _ in range(ROUNDS):
                for name, (attend_with, gelu) in variants.items():
                    shared.model.MLP.forward = lambda self, x, gelu=gelu: self.c_proj(gelu(self.c_fc(x)))
                    model.forward_packed(input_ids, positions, attend_with, logits_indices)
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        model.forward_packed(input_ids, positions, attend_with, logits_indices)
                    times[name].append((time.perf_counter() - started) / CALLS * 1e3)
                started = time.perf_counter()
                for _ in range(CALLS):
                    run_products()
                times["matrix products alone"].append((time.perf_counter() - started) / CALLS * 1e3)
    finally:
        shared.model.MLP.forward = served_mlp
    ms = {name: statistics.median(values) for name, values in times.items()}
    step, floor = ms["step, GELU served"], ms["matrix products alone"]
    attention = step - ms["step, attention skipped"]
    gelu = step - ms["step, GELU identity"]
    rest = ms["step, attention skipped, GELU identity"] - floor
    print(f"{cpu_description()}, torch {torch.__version__}, one thread; {loop.label}")
    print(f"one decode step of {ROWS} rows replayed; median of {ROUNDS} interleaved rounds of {CALLS} calls\n")
    for name, value in ms.items():
        print(f"  {name:<40} {value:7.2f} ms  {value / step:5.2f}x the step")
    print(f"\nthe step, {step:.2f} ms, is {step / floor:.2f}x its matrix products alone ({gflop:.3f} GFLOP, {floor:.2f} ms):")
    print(f"  decode attention (the step without it)  {attention:6.2f} ms  {attention / step:4.0%}")
    print(f"  GELU (the step with the identity)       {gelu:6.2f} ms  {gelu / step:4.0%}")
    print(f"  the rest beyond the products            {rest:6.2f} ms  {rest / step:4.0%}  (LayerNorm, residuals, views, Python)")
    print(f"  the step without attention and GELU is {ms['step, attention skipped, GELU identity'] / floor:.2f}x the products")


if __name__ == "__main__":
    main()
