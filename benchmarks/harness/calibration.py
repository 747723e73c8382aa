"""How fast is this machine, apart from any server? A few seconds of measurement stored in every results file.

Two figures a learner can compare with the reference's to tell a slower machine from a slower server:

- the GFLOP/s of the model's own matrix products (every distinct linear layer's shape, at 1 row, one
  request decoding, and at 64 rows, a full batch), on the benchmark's thread count, in fp32 and in
  bf16 (bf16 is slow on CPUs without native support, and may be unsupported: what happened is
  recorded in ``bf16_note``);
- the engine's requests per second with no server around it: chapter 3's ``generate_batch`` on the
  profile's model, prompts from the workload's mix, 32 new tokens, at batch 1 and 64.

If a learner's calibration is, say, half the reference's and their climb is half too, the machine
explains it; if their calibration matches and their climb does not, look at the server (or at what
else runs on the machine).

Run as a subprocess by the harness, pinned to the server's cores with the server's thread settings:

    python -m benchmarks.harness.calibration --weights=default --device=cpu --torch-threads=1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from benchmarks.harness.results import Calibration, MatmulRate
from benchmarks.harness.workload import DEFAULT_SEED, PromptStream, get_workload

MATMUL_ROWS = (1, 64)
ENGINE_BATCHES = (1, 64)
ENGINE_NEW_TOKENS = 32
MEASURE_S = 0.08  # per matrix-product timing: long enough to cover timer noise, short enough to stay a few seconds
BATCH1_REQUESTS = 4

if TYPE_CHECKING:  # torch is imported where it is used: the harness and the notebooks import this module
    import torch


def linear_shapes(n_embd: int, vocab_size: int) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of every distinct linear layer of the GPT-2 architecture."""
    return [
        ("attn.c_attn", n_embd, 3 * n_embd),
        ("attn.c_proj", n_embd, n_embd),
        ("mlp.c_fc", n_embd, 4 * n_embd),
        ("mlp.c_proj", 4 * n_embd, n_embd),
        ("lm_head", n_embd, vocab_size),
    ]


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(call: Callable[[], object], device: torch.device, measure_s: float = MEASURE_S) -> float:
    """Seconds per call: one call to warm up, then calls until ``measure_s`` has passed (at least 3)."""
    call()
    _synchronize(device)
    calls, began = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - began < measure_s:
        call()
        calls += 1
    _synchronize(device)
    return (time.perf_counter() - began) / calls


def matmul_gflops(rows: int, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device) -> float:
    """GFLOP/s of ``linear(x[rows, in], w[out, in])`` (2 x rows x in x out FLOPs a call)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=generator).to(device=device, dtype=dtype)
    w = torch.randn(out_features, in_features, generator=generator).to(device=device, dtype=dtype)
    with torch.inference_mode():
        seconds = time_per_call(lambda: torch.nn.functional.linear(x, w), device)
    return 2 * rows * in_features * out_features / seconds / 1e9


def measure_matmuls(n_embd: int, vocab_size: int, device: torch.device) -> tuple[list[MatmulRate], str | None]:
    """Every shape at every row count, fp32 and bf16; the note says why bf16 has no figure, if so."""
    import torch

    rates, bf16_note = [], None
    for rows in MATMUL_ROWS:
        for name, fan_in, fan_out in linear_shapes(n_embd, vocab_size):
            fp32 = matmul_gflops(rows, fan_in, fan_out, torch.float32, device)
            bf16 = None
            if bf16_note is None:
                try:
                    bf16 = matmul_gflops(rows, fan_in, fan_out, torch.bfloat16, device)
                except (RuntimeError, TypeError) as exc:  # an unsupported dtype on this device/build
                    bf16_note = f"bf16 unsupported here: {type(exc).__name__}: {str(exc)[:200]}"
            rates.append(MatmulRate(name=name, rows=rows, in_features=fan_in, out_features=fan_out,
                                    fp32_gflops=fp32, bf16_gflops=bf16))
    return rates, bf16_note


def combined_gflops(rates: Sequence[MatmulRate], attribute: str) -> dict[str, float | None]:
    """Per row count: total FLOPs over total time of the shapes, i.e. the rate of one pass over every layer shape."""
    combined: dict[str, float | None] = {}
    for rows in sorted({rate.rows for rate in rates}):
        flops = seconds = 0.0
        for rate in (r for r in rates if r.rows == rows):
            value = getattr(rate, attribute)
            if value is None:
                combined[str(rows)] = None
                break
            work = 2 * rate.rows * rate.in_features * rate.out_features
            flops, seconds = flops + work, seconds + work / (value * 1e9)
        else:
            combined[str(rows)] = flops / seconds / 1e9 if seconds else None
    return combined


def engine_requests_per_s(model, pad_id: int, device: torch.device) -> dict[str, float]:
    """Requests per second of chapter 3's batched generation at each batch size, no server around it."""
    import torch

    from chapters.ch03_dynamic_batching.batched_generation import generate_batch

    stream = PromptStream(get_workload("default"), seed=DEFAULT_SEED + 7, user_index=0)
    rates = {}
    with torch.inference_mode():
        generate_batch(model, [stream.next_body()["input_ids"]], [ENGINE_NEW_TOKENS], pad_id)  # warm-up
        for batch in ENGINE_BATCHES:
            rounds = BATCH1_REQUESTS if batch == 1 else 1
            prompts = [[stream.next_body()["input_ids"] for _ in range(batch)] for _ in range(rounds)]
            _synchronize(device)
            began = time.perf_counter()
            for group in prompts:
                rows = generate_batch(model, group, [ENGINE_NEW_TOKENS] * len(group), pad_id)
                if len(rows) != len(group) or any(len(row.output_ids) != ENGINE_NEW_TOKENS for row in rows):
                    raise RuntimeError("generate_batch returned the wrong number of rows or tokens")
            _synchronize(device)
            rates[str(batch)] = batch * rounds / (time.perf_counter() - began)
    return rates


def calibrate(weights: str = "default", preset: str = "tiny", device: str = "cpu", torch_threads: int = 1) -> Calibration:
    """Measure everything; a part that fails is reported in ``error`` and the rest kept."""
    import torch

    from shared.weights import load_model

    began = time.perf_counter()
    torch.set_num_threads(torch_threads)
    target = torch.device(device)
    loaded = load_model(weights=weights, preset=preset, device=target)
    config = loaded.model.config
    rates, bf16_note = measure_matmuls(config.n_embd, config.vocab_size, target)
    error, engine = None, {}
    try:
        engine = engine_requests_per_s(loaded.model, loaded.tokenizer.pad_id, target)
    except Exception as exc:  # noqa: BLE001 - the matrix figures are still worth having
        error = f"engine: {type(exc).__name__}: {exc}"
    return Calibration(
        model=loaded.source, device=str(target), torch_threads=torch_threads,
        fp32_gflops={k: v for k, v in combined_gflops(rates, "fp32_gflops").items() if v is not None},
        bf16_gflops=combined_gflops(rates, "bf16_gflops"), bf16_note=bf16_note, matmuls=rates,
        engine_new_tokens=ENGINE_NEW_TOKENS, engine_rps=engine, seconds=time.perf_counter() - began, error=error,
    )


def model_flags(server_args: Sequence[str]) -> dict[str, str | int]:
    """``weights``, ``preset``, ``device``, ``torch_threads`` from a profile's server flags (``--name=value``)."""
    wanted = {"--weights": "weights", "--preset": "preset", "--device": "device", "--torch-threads": "torch_threads"}
    flags: dict[str, str | int] = {}
    for arg in server_args:
        name, _, value = arg.partition("=")
        if name in wanted and value:
            flags[wanted[name]] = int(value) if name == "--torch-threads" else value
    return flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.calibration", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="default")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args(argv)
    result = calibrate(args.weights, args.preset, args.device, args.torch_threads)
    json.dump(result.model_dump(), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
