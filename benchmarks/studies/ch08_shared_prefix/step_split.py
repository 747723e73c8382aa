"""Where a decode step of 64 rows spends its time beyond its matrix products, measured in place.

One pure decode step of chapter 8's engine (64 rows, the default workload, ``ch08_step_profile``'s
closed loop) is captured and replayed, in process and on one thread, in turns with variants of
itself: attention that returns its queries (no cache read); the MLP unfused, GELU computed after
its first product (torch's tanh GELU, the identity, the same tanh approximation through a sigmoid
in place, the exact erf GELU for scale), where the served MLP fuses it (chapter 5's ``Bf16MLP``);
attention skipped with GELU the identity; and the model's linear layers alone on 64 rows.
Replaying writes the same slots again, which changes no timing. The differences split the step:

    python -m benchmarks.studies.ch08_shared_prefix.step_split --attention kernel > benchmarks/studies/ch08_shared_prefix/step-split-kernel.txt
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import math
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import shared.model
from benchmarks.harness.environment import cpu_description
from benchmarks.studies.ch08_shared_prefix.step_vs_products import ROWS, products
from benchmarks.studies.ch08_step_profile.profile_ch08 import closed_loop
from chapters.ch08_continuous_batching.fast.attention_kernel import KERNEL_ARGUMENTS, KERNEL_FLAGS, KERNEL_FUNCTIONS, KERNEL_SOURCE
from benchmarks.studies.ch08_shared_prefix.compiled_layers import compile_layers

ROUNDS, CALLS = 15, 20


def gelu_through_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """tanh(z) = 2·sigmoid(2z) − 1: the served function, in one buffer written in place."""
    inner = torch.addcmul(x, x * x, x, value=0.044715)
    return inner.mul_(2 * math.sqrt(2 / math.pi)).sigmoid_().mul_(x)


GELUS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": lambda x: F.gelu(x, approximate="tanh"),
    "identity": lambda x: x,
    "via sigmoid, in place": gelu_through_sigmoid,
    "exact (erf)": F.gelu,
}


def revision_kernel_source(revision: str) -> str:
    """``kernel_source_at(revision)``, refused where its signature predates grouped-query attention."""
    source = kernel_source_at(revision)
    if "int64_t kv_heads" not in source:
        raise SystemExit(f"paged_decode.c as of {revision} has no kv_heads argument (before grouped-query attention):"
                         " pass a revision from the commit that added it on")
    return source


def kernel_source_at(revision: str) -> str:
    """``paged_decode.c`` as of git ``revision``."""
    root = Path(__file__).resolve().parents[3]  # the repository's
    return subprocess.run(["git", "-C", str(root), "show", f"{revision}:{KERNEL_SOURCE.relative_to(root).as_posix()}"],
                          capture_output=True, text=True, check=True).stdout


def kernel_of(revision: str, dtype: torch.dtype, directory: str) -> Callable:
    """``paged_decode.c`` as of git ``revision``, built with the chapter's flags: its function for ``dtype``.

    The revision's kernel must take today's arguments (``kv_heads`` after ``heads``): SystemExit where it does not."""
    (Path(directory) / "kernel.c").write_text(revision_kernel_source(revision))
    subprocess.run(["cc", *KERNEL_FLAGS, "-o", f"{directory}/kernel.so", f"{directory}/kernel.c", "-lm"], check=True,
                   capture_output=True)
    function = getattr(ctypes.CDLL(f"{directory}/kernel.so"), KERNEL_FUNCTIONS[dtype])
    function.argtypes, function.restype = KERNEL_ARGUMENTS, None
    return function


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="kernel", choices=("gather", "flex", "kernel"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--kernel-of", metavar="REV", help="also replay the step with paged_decode.c as of this git revision")
    parser.add_argument("--compiled-layers", action="store_true",
                        help="also replay the step with each layer's halves compiled (compiled_layers.py beside this), on a copy of the model")
    args = parser.parse_args(argv)
    loop = closed_loop(args.attention, args.precision, "default", kv_cache=args.kv_cache_dtype)
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
    mlp_class = type(model.h[0].mlp)  # shared.model.MLP, or chapter 5's Bf16MLP under a bf16 engine
    served_mlp = mlp_class.forward

    def unfused(gelu: Callable) -> Callable:
        return lambda self, x: self.c_proj(gelu(self.c_fc(x)))

    variants = {"step, as served": (attend, served_mlp, None)}
    variants |= {f"step, GELU {name} after the product": (attend, unfused(gelu), None) for name, gelu in GELUS.items()}
    variants |= {"step, attention skipped": (no_attention, served_mlp, None),
                 "step, attention skipped, GELU identity": (no_attention, unfused(GELUS["identity"]), None)}
    run_products, gflop = products(torch.bfloat16 if args.precision == "bf16" else torch.float32)
    config, kv_dtype = loop.engine.runner.store.config, loop.engine.runner.store.pool.storage.dtype
    backend = loop.engine.runner.attention
    served_kernel, build_dir = getattr(backend, "_decode", None), tempfile.TemporaryDirectory()
    other = f"step, the kernel of {args.kernel_of}"
    if args.kernel_of:
        if served_kernel is None:
            parser.error("--kernel-of compares builds of the kernel backend: pass --attention kernel")
        variants[other] = (attend, served_mlp, kernel_of(args.kernel_of, kv_dtype, build_dir.name))
    compiled = None
    if args.compiled_layers:
        compiled = copy.deepcopy(model)
        compile_layers(compiled)
        variants |= {"step, layers compiled": (attend, None, None), "step, layers compiled, attention skipped": (no_attention, None, None)}
    context_tokens = int(positions.sum()) + ROWS  # every row decodes: it attends to its position and those before
    read_bytes = context_tokens * 2 * config.kv_width * config.n_layer * kv_dtype.itemsize
    reads = torch.ones(read_bytes // 4, dtype=torch.float32)  # the same bytes, summed as fp32 whatever the cache's dtype
    times: dict[str, list[float]] = {name: [] for name in [*variants, "matrix products alone", "reads alone"]}
    try:
        with torch.no_grad():
            for _ in range(ROUNDS):
                for name, (attend_with, mlp_forward, kernel) in variants.items():
                    # None: the compiled copy, which runs the served MLP (a patched one would make it compile again)
                    mlp_class.forward = mlp_forward or served_mlp
                    if served_kernel is not None:
                        backend._decode = kernel or served_kernel
                    runs = compiled if mlp_forward is None else model
                    runs.forward_packed(input_ids, positions, attend_with, logits_indices)
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        runs.forward_packed(input_ids, positions, attend_with, logits_indices)
                    times[name].append((time.perf_counter() - started) / CALLS * 1e3)
                started = time.perf_counter()
                for _ in range(CALLS):
                    run_products()
                times["matrix products alone"].append((time.perf_counter() - started) / CALLS * 1e3)
                started = time.perf_counter()
                for _ in range(CALLS):
                    reads.sum(dtype=torch.float32)
                times["reads alone"].append((time.perf_counter() - started) / CALLS * 1e3)
    finally:
        mlp_class.forward = served_mlp
        if served_kernel is not None:
            backend._decode = served_kernel
        build_dir.cleanup()
    ms = {name: statistics.median(values) for name, values in times.items()}
    step, floor = ms["step, as served"], ms["matrix products alone"]
    attention = step - ms["step, attention skipped"]
    unfused_step = ms["step, GELU tanh after the product"]
    gelu = unfused_step - ms["step, GELU identity after the product"]
    rest = ms["step, attention skipped, GELU identity"] - floor
    print(f"{cpu_description()}, torch {torch.__version__}, one thread; {loop.label}")
    print(f"one decode step of {ROWS} rows replayed; median of {ROUNDS} interleaved rounds of {CALLS} calls\n")
    for name, value in ms.items():
        print(f"  {name:<40} {value:7.2f} ms  {value / step:5.2f}x the step")
    print(f"\nthe step, {step:.2f} ms, is {step / floor:.2f}x its matrix products alone ({gflop:.3f} GFLOP, {floor:.2f} ms):")
    print(f"  decode attention (the step without it)  {attention:6.2f} ms  {attention / step:4.0%}")
    print(f"  GELU after its product (unfused: tanh less the identity) {gelu:6.2f} ms  {gelu / step:4.0%}")
    print(f"  the rest beyond the products            {rest:6.2f} ms  {rest / step:4.0%}  (LayerNorm, residuals, casts, views, Python)")
    if mlp_class is not shared.model.MLP:
        print(f"  less what {mlp_class.__name__} saves (the MLP unfused less as served) {unfused_step - step:6.2f} ms: "
              f"the unfused step is {unfused_step / step:.2f}x the step")
    print(f"  the step without attention and GELU is {ms['step, attention skipped, GELU identity'] / floor:.2f}x the products")
    if args.compiled_layers:
        step_c = ms["step, layers compiled"]
        print(f"  with its layers compiled the step is {step_c:.2f} ms, {step_c / step:.2f}x the step and {step_c / floor:.2f}x "
              f"the products; without attention {ms['step, layers compiled, attention skipped'] / floor:.2f}x the products")
    if args.kernel_of:
        print(f"  the step with the kernel of {args.kernel_of} is {ms[other] / step:.2f}x the step; this kernel takes "
              f"{attention / (ms[other] - ms['step, attention skipped']):.2f}x that one's attention")
    read = ms["reads alone"]
    print(f"\nattention's bytes: {context_tokens} positions of context, keys and values, {config.n_layer} layers, "
          f"{str(kv_dtype).removeprefix('torch.')}: {read_bytes / 2**20:.1f} MiB a step")
    print(f"  read alone, one contiguous sum:        {read:6.2f} ms  ({read_bytes / read / 1e6:.1f} GB/s); "
          f"attention takes {attention / read:.2f}x its reads")
    print(f"  products + reads alone:                {floor + read:6.2f} ms  = {(floor + read) / floor:.2f}x the products "
          f"(the 1.5x target: {1.5 * floor:.2f} ms)")


if __name__ == "__main__":
    main()
