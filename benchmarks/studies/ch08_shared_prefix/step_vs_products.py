"""A decode step of chapter 8 at 64 rows against its matrix products alone, at the same shapes and precision.

In process, one thread: chapter 8's engine in a closed loop (``ch08_step_profile``'s) with 64
sequences decoding, and, taking turns with it, the model's own linear layers (every block's
``c_attn``, ``attn.c_proj``, ``c_fc``, ``mlp.c_proj``) and the output layer called on 64 rows of
``--precision``'s dtype (bf16: weights and inputs cast, the weights in oneDNN's layout as chapter 5 serves them). The products' time is the floor a step could reach if attention, LayerNorm,
GELU and the Python between layers cost nothing; the ratio is how far above it a step runs.

    python -m benchmarks.studies.ch08_shared_prefix.step_vs_products --precision fp32 --attention flex
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.harness.environment import cpu_description
from benchmarks.studies.ch08_step_profile.profile_ch08 import closed_loop
from chapters.ch05_inference_engine.bf16_matmul import linear_bf16, onednn_layout
from shared.weights import load_model

ROWS, ROUNDS, STEPS = 64, 7, 20


def products(dtype: torch.dtype) -> tuple[Callable[[], None], float]:
    """A call that runs the default model's linear layers and its output layer on ``ROWS`` rows in ``dtype``
    (weights and inputs), and their GFLOP. From the plain model: a bf16 engine on a CPU wraps its layers."""
    model = load_model("default").model
    layers = [(m.weight.detach().to(dtype), m.bias.detach().to(dtype)) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    layers.append((model.wte.weight.detach().to(dtype), None))  # the output layer (tied to the embedding)
    inputs = {w.shape[1]: torch.randn(ROWS, w.shape[1], dtype=dtype) for w, _ in layers}
    gflop = sum(2 * ROWS * w.shape[0] * w.shape[1] for w, _ in layers) / 1e9
    if dtype == torch.bfloat16:  # bf16 weights as chapter 5 serves them: laid out once for oneDNN, the fastest form here
        layers = [(onednn_layout(w), b) for w, b in layers]

    def run() -> None:
        for w, b in layers:
            linear_bf16(inputs[w.shape[1]], w, b)

    return run, gflop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--attention", default="flex", choices=("gather", "flex", "kernel"))
    args = parser.parse_args(argv)
    loop = closed_loop(args.attention, args.precision, "default")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    run_products, gflop = products(dtype)
    run_products()
    step_ms, product_ms = [], []
    with torch.no_grad():
        for _ in range(ROUNDS):
            _, _, records = loop.timed(STEPS)
            step_ms += [r.model_ms for r in records if r.decode_rows == ROWS and r.prefill_tokens == 0]
            started = time.perf_counter()
            for _ in range(STEPS):
                run_products()
            product_ms.append((time.perf_counter() - started) / STEPS * 1e3)
    step, floor = statistics.median(step_ms), statistics.median(product_ms)
    print(f"{cpu_description()}, torch {torch.__version__}, one thread; {loop.label}")
    print(f"decode step of {ROWS} rows, model time: median {step:.2f} ms over {len(step_ms)} steps")
    print(f"its matrix products alone ({gflop:.3f} GFLOP, weights in {str(dtype).removeprefix('torch.')}): median {floor:.2f} ms "
          f"({gflop / floor * 1e3:.1f} GFLOP/s)")
    print(f"step / products: {step / floor:.2f}x")


if __name__ == "__main__":
    main()
