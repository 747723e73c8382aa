"""Where a decode step's time goes inside the model: ``python -m benchmarks.studies.decode_attention.decode_attention``.

Chapter 8's step is almost all ``model`` time (``profile_ch08``), and on ``mixed`` about half of
that is the decode rows' attention. This measures one layer's attention for ``--rows`` decoding
sequences, side by side in interleaved rounds (one torch thread, the server's defaults otherwise),
each candidate reading the SAME contexts:

``flex``            chapter 8's backend as served: write the new keys and values, run the compiled
                    ``flex_attention`` over the pool in place, copy the rows in and out
``flex kernel``     the compiled ``flex_attention`` call alone
``kernel``          chapter 8's ``kernel`` backend as served: its C call and the output tensor
                    around it (the writes and copies of ``flex`` are inside the call)
``kernel call``     its C kernel's call alone (``paged_decode.c``: writes the new keys and values,
                    then one query row at a time, the softmax over the whole row, no library call
                    per block)
``gather``          the readable backend as served: copy each history out of its blocks, then SDPA
``compiled gather`` a candidate that was tried and is not served: the same reads written as plain
                    PyTorch through a per-row slot table (``k_plane[slots]``), compiled by
                    TorchInductor, which fuses the indexing into the dot products (no copy)
``dense cache``     SDPA over a contiguous ``(rows, heads, longest, head_dim)`` cache with a padding
                    mask: chapter 6's layout, no paging at all; what a library kernel reaches when
                    the keys lie in one piece
``copy``            ``index_select`` of exactly the blocks the step reads (keys and values): the
                    copy ``gather`` makes before its SDPA (a copy reads the bytes and writes them)

Contexts are what a closed loop of the workload holds: a prompt of the workload's lengths plus a
uniform share of its answer. Block tables are scattered over the pool, as a busy pool scatters them.

The second part measures the rest of the packed step (every layer without attention, the output
layer) eagerly and under ``torch.compile`` with dynamic token counts (the attention call is a graph
break, as it is with every backend): whether compiling the step is the lever it is for vLLM's CPU
backend, at the token counts a step computes.

    python -m benchmarks.studies.decode_attention.decode_attention --workload default --out benchmarks/reference/cpu/ch08/decode-attention-default.json
    python -m benchmarks.studies.decode_attention.decode_attention --workload mixed --out benchmarks/reference/cpu/ch08/decode-attention-mixed.json
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.environment import cpu_model
from benchmarks.harness.results import print_and_save
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager, multiplies_in_bf16
from chapters.ch08_continuous_batching.model_runner import packed_model
from chapters.ch08_continuous_batching.fast.attention_choice import scattered_decode_inputs
from chapters.ch08_continuous_batching.fast.attention_flex import FlexAttention
from chapters.ch08_continuous_batching.attention_gather import GatherAttention
from chapters.ch08_continuous_batching.fast.attention_kernel import KernelAttention, scores_scratch
from chapters.ch08_continuous_batching.paged_attention import block_table_tensor
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.server import ContinuousSettings
from shared.weights import load_model

PROMPTS = (16, 32, 64, 128)
ANSWERS = {"default": (32,), "mixed": (8, 16, 32, 64, 128, 256)}


def contexts(workload: str, rows: int, rng: random.Random) -> list[int]:
    """Context lengths of ``rows`` sequences in the middle of their answers."""
    return [rng.choice(PROMPTS) + rng.randrange(rng.choice(ANSWERS[workload])) + 1 for _ in range(rows)]


def compiled_gather(heads: int, head_dim: int) -> Callable:
    """The candidate: attention of one query per row through a (rows, longest) slot table, compiled."""

    def attend(q, k_plane, v_plane, slots, lens):  # q (R, H, D) fp32; planes (slots, H * D); slots (R, S)
        rows, longest = slots.shape
        k = k_plane[slots].view(rows, longest, heads, head_dim).float()
        v = v_plane[slots].view(rows, longest, heads, head_dim).float()
        scores = (q[:, None] * k).sum(-1) * (1.0 / math.sqrt(head_dim))  # (R, S, H)
        valid = torch.arange(longest, device=slots.device)[None, :] < lens[:, None]
        weights = torch.softmax(scores.masked_fill(~valid[:, :, None], float("-inf")), dim=1)
        return (weights[..., None] * v).sum(1)  # (R, H, D)

    return torch.compile(attend, dynamic=True)


def interleaved(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, dict[str, float]]:
    """Each candidate once per round, in turn; min and median milliseconds over the rounds."""
    for call in candidates.values():
        call()  # compile, first touch
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, call in candidates.items():
            started = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - started)
    return {name: {"min_ms": round(min(s) * 1e3, 3), "median_ms": round(statistics.median(s) * 1e3, 3)}
            for name, s in samples.items()}


def attention_part(workload: str, rows: int, rounds: int, precision: str, seed: int, block_tokens: int | None = None) -> dict:
    loaded = load_model("default")
    config = loaded.config
    engine = build_eager(loaded.model, precision)
    kv_dtype = kv_cache_dtype("auto", multiplies_in_bf16(engine), engine.dtype)
    settings = ContinuousSettings()
    pool = KVMemoryPool(config, 512 * rows * 2, block_tokens=block_tokens or settings.block_tokens, dtype=kv_dtype)
    store = PagedKVStore(pool)
    size, heads, head_dim = store.block_tokens, config.n_head, config.head_dim
    rng = random.Random(seed)
    for layer in range(config.n_layer):
        for kv in (0, 1):
            store.plane(layer, kv).copy_(torch.randn(store.plane(layer, kv).shape))
    lens = contexts(workload, rows, rng)
    inputs, _ = scattered_decode_inputs(store, lens, rng)
    tables = inputs.block_tables
    q, k, v = (torch.randn(1, heads, rows, head_dim) for _ in range(3))

    flex, gather, kernel = FlexAttention(store), GatherAttention(store), KernelAttention(store)
    flex_attend, gather_attend, kernel_attend = flex.bind(inputs), gather.bind(inputs), kernel.bind(inputs)
    kernel_tables = block_table_tensor(tables, lens, size, store.first_block)
    kernel_lens, kernel_out = torch.tensor(lens, dtype=torch.int32), torch.empty(rows, heads, head_dim)
    kernel_scratch, kernel_slots = scores_scratch(heads, config.n_ctx), inputs.slot_mapping.clone()
    bucket = flex._buckets[max(FlexAttention.MIN_BUCKET, 1 << (rows - 1).bit_length())]
    pool_keys, pool_values = (store.plane(0, kv).view(-1, heads, head_dim).permute(1, 0, 2)[None] for kv in (0, 1))
    flex_queries = torch.randn(bucket.rows, heads, 1, head_dim).to(kv_dtype)

    longest = max(lens)
    slot_table = torch.zeros(rows, longest, dtype=torch.long)
    for row, (table, context) in enumerate(zip(tables, lens)):
        blocks = torch.tensor(table[: -(-context // size)])
        slot_table[row, :context] = (blocks[:, None] * size + torch.arange(size)).flatten()[:context]
    lens_tensor = torch.tensor(lens)
    candidate = compiled_gather(heads, head_dim)
    rows_q = q[0].transpose(0, 1).contiguous()

    dense_k, dense_v = (store.plane(0, kv)[slot_table].view(rows, longest, heads, head_dim).transpose(1, 2).contiguous()
                        for kv in (0, 1))
    dense_mask = (torch.arange(longest)[None, :] < lens_tensor[:, None])[:, None, None, :]
    dense_q = q[0].transpose(0, 1)[:, :, None].to(kv_dtype)

    read_blocks = torch.tensor([b for table, context in zip(tables, lens) for b in table[: -(-context // size)]])
    block_rows = [flex.blocks(0, kv) for kv in (0, 1)]

    timings = interleaved({
        "flex": lambda: flex_attend(0, q, k, v),
        "flex kernel": lambda: flex._flex(flex_queries, pool_keys, pool_values, block_mask=bucket.block_mask,
                                          kernel_options=flex.KERNEL_OPTIONS),
        "kernel": lambda: kernel_attend(0, q, k, v),
        "kernel call": lambda: kernel._decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(2), q.stride(1),
                                              kernel_slots.data_ptr(), store.plane(0, 0).data_ptr(),
                                              store.plane(0, 1).data_ptr(), kernel_tables.data_ptr(), kernel_tables.shape[1],
                                              kernel_lens.data_ptr(), rows, heads, config.kv_heads, head_dim, size, kernel._scale,
                                              kernel_scratch.data_ptr(), kernel_out.data_ptr(), kernel_out.stride(0)),
        "gather": lambda: gather_attend(0, q, k, v),
        "compiled gather": lambda: candidate(rows_q, store.plane(0, 0), store.plane(0, 1), slot_table, lens_tensor),
        "dense cache": lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, attn_mask=dense_mask),
        "copy": lambda: [plane.index_select(0, read_blocks) for plane in block_rows],
    }, rounds)
    element = torch.empty((), dtype=kv_dtype).element_size()
    bytes_read = sum(lens) * config.kv_width * 2 * element
    dense_bytes = rows * longest * config.kv_width * 2 * element  # the padded cache SDPA reads
    return {
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."), "engine": engine.label, "rows": rows,
        "block_tokens": size, "context_median": statistics.median(lens), "context_max": longest,
        "bytes_read_mb": round(bytes_read / 1e6, 2), "dense_cache_bytes_mb": round(dense_bytes / 1e6, 2), "per_layer": timings,
        "gb_per_s_at_min": {name: round(bytes_read / (t["min_ms"] / 1e3) / 1e9, 2) for name, t in timings.items()},
    }


def step_part(token_counts: list[int], rounds: int, precision: str) -> dict:
    loaded = load_model("default")
    model = packed_model(build_eager(loaded.model, precision))

    @torch._dynamo.disable
    def no_attention(layer, q, k, v):
        return q.clone()

    compiled = torch.compile(model.forward_packed, dynamic=True)
    out = {}
    for tokens in token_counts:
        ids, positions = torch.randint(0, 256, (tokens,)), torch.randint(0, 128, (tokens,))
        logits_at = torch.arange(min(tokens, 64))
        out[str(tokens)] = interleaved({
            "eager": lambda: model.forward_packed(ids, positions, no_attention, logits_at),
            "compiled": lambda: compiled(ids, positions, no_attention, logits_at),
        }, rounds)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="default", choices=sorted(ANSWERS))
    parser.add_argument("--rows", type=int, default=64, help="decoding sequences (the server's max_num_seqs)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="chapter 5's engine (bf16: this machine's rule's choice where it has native bf16)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[64, 192, 512], help="token counts of the step part (none: skip it)")
    parser.add_argument("--block-tokens", type=int, default=None, help="the pool's block (default: the server's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    document = {
        "kind": "decode-attention", "started_at": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": cpu_model(),
        "torch": torch.__version__, "workload": args.workload, "rounds": args.rounds,
        "attention": attention_part(args.workload, args.rows, args.rounds, args.precision, args.seed, args.block_tokens),
        "step_without_attention": step_part(args.tokens, args.rounds, args.precision) if args.tokens else None,
        "command": "python -m benchmarks.studies.decode_attention.decode_attention " + shlex.join(sys.argv[1:] if argv is None else argv),
    }
    print_and_save(document, args.out)


if __name__ == "__main__":
    main()
