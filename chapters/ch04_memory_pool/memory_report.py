"""``python -m chapters.ch04_memory_pool.memory_report``: where the memory of inference goes, computed from the model's shape."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from chapters.ch04_memory_pool.memory_pool import (
    DEFAULT_HEADROOM,
    kv_bytes_per_request,
    pool_tokens_by_rule,
)
from shared.model import PRESETS, ModelConfig, build_model
from shared.weights import DEFAULT_CONTEXT_CAP

MiB = 2**20


@dataclass(frozen=True)
class MemoryFigures:
    name: str
    dtype: torch.dtype
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int  # at the longest sequence (n_ctx)
    pool_bytes: int  # the sizing rule at ``concurrency`` requests
    activation_bytes: int  # largest single activation of a prefill of ``batch`` x ``prompt`` tokens


def count_parameters(config: ModelConfig) -> int:
    with torch.device("meta"):
        return build_model(config).num_parameters()


def largest_activation_bytes(config: ModelConfig, batch: int, prompt: int, dtype: torch.dtype) -> int:
    """Bytes of the biggest tensor a prefill creates: the MLP's hidden layer (two in a gated MLP), or the last logits.
    Assumes a fused attention kernel (no T x T scores stored); workspaces and the allocator's caching come on top."""
    element = torch.tensor([], dtype=dtype).element_size()
    mlp_hidden = batch * prompt * config.mlp_width * (2 if config.family == "llama" else 1)
    last_logits = batch * config.vocab_size
    return max(mlp_hidden, last_logits) * element


def figures(name: str, config: ModelConfig, dtype: torch.dtype, concurrency: int, batch: int, prompt: int) -> MemoryFigures:
    parameters = count_parameters(config)
    element = torch.tensor([], dtype=dtype).element_size()
    return MemoryFigures(
        name=name,
        dtype=dtype,
        parameters=parameters,
        weight_bytes=parameters * element,
        kv_bytes_per_token=config.kv_bytes_per_token(dtype),
        kv_bytes_per_request=kv_bytes_per_request(config, config.n_ctx, dtype),
        pool_bytes=pool_tokens_by_rule(config.n_ctx, concurrency, DEFAULT_HEADROOM) * config.kv_bytes_per_token(dtype),
        activation_bytes=largest_activation_bytes(config, batch, prompt, dtype),
    )


def render(rows: list[MemoryFigures], concurrency: int, batch: int, prompt: int) -> str:
    header = (
        "| model | dtype | parameters | weights | KV per token | KV per request at n_ctx "
        f"| pool: n_ctx x {concurrency} x {DEFAULT_HEADROOM} | largest activation, prefill {batch} x {prompt} |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row.name} | {str(row.dtype).removeprefix('torch.')} | {row.parameters / 1e6:.2f} M "
            f"| {row.weight_bytes / MiB:.1f} MiB | {row.kv_bytes_per_token / 1024:.0f} KiB "
            f"| {row.kv_bytes_per_request / MiB:.1f} MiB | {row.pool_bytes / MiB:,.0f} MiB "
            f"| {row.activation_bytes / MiB:.1f} MiB |"
        )
    return "\n".join(lines)


SMOLLM2 = PRESETS["smollm2-135m"]
# SmolLM2 twice: at the context served by default, and at its own 8k, where the rule's pool outgrows the machine.
MODEL_SHAPES = (("tiny / default", PRESETS["tiny"]), ("gpt2", PRESETS["gpt2"]),
                ("smollm2 served", dataclasses.replace(SMOLLM2, n_ctx=DEFAULT_CONTEXT_CAP)), ("smollm2 own", SMOLLM2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64, help="the rule's maximum concurrency (the server's default)")
    parser.add_argument("--batch", type=int, default=32, help="prefill batch for the activation estimate")
    parser.add_argument("--prompt", type=int, default=128, help="prompt length for the activation estimate")
    args = parser.parse_args(argv)
    rows = [
        figures(f"{name} (n_ctx {config.n_ctx})", config, dtype, args.concurrency, args.batch, args.prompt)
        for name, config in MODEL_SHAPES
        for dtype in (torch.float32, torch.float16)
    ]
    print(render(rows, args.concurrency, args.batch, args.prompt))


if __name__ == "__main__":
    main()
