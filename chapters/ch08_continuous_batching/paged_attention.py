"""Attention that reads the paged cache where it lies: the seam between a packed step and the pool.

A packed step (:mod:`~chapters.ch08_continuous_batching.model_runner`) hands the model ONE row of
every token it computes. Linear layers do not care which sequence a token belongs to; attention
does: token ``j`` of sequence ``i`` may read sequence ``i``'s keys at positions ``0 .. p_j`` and
nothing else. So each layer's attention gets the step's layout (:class:`PackedInputs`: where each
sequence's queries start, its context length, its block table, the slot of every new token) and:

1. **writes** this step's new keys and values into their slots of the pool (``index_copy_`` along
   the slot mapping: a scatter, one row per token);
2. **attends**: each query reads its own sequence's keys and values through the block table.

Three backends do step 2 (``--attention``); each is tested token-exact against the oracle:

``gather``  the readable version. Each decoding sequence's blocks are copied out of the pool, whole
            blocks at a time (``index_select`` over the pool viewed as one row per block), into a
            padded batch that SDPA reads with a mask over the padding; each prompt chunk attends
            alone (a first chunk needs no copy: its keys are the ones just computed). The copy is
            the price of plain PyTorch: every decode step reads each history, writes it again and
            reads the copy.
``flex``    the decode rows through :func:`torch.nn.attention.flex_attention` with a ``BlockMask``
            built from the block tables, compiled by TorchInductor (C++ on the CPU, Triton on a
            GPU): the kernel visits only the listed blocks of the pool, in place, no copy. Prompt
            chunks as ``gather`` (their cost is the linear layers'). Needs ``torch.compile`` and a
            C++ compiler; where either is missing it is unavailable, with the reason. Each new
            batch-size bucket (16, 32, 64, ... decode rows) compiles once, a few seconds.

``kernel``  the decode rows through this chapter's own C kernel (``paged_decode.c``), reading the pool
            in place: one call per layer for all decode rows, each row's softmax computed over the
            whole row at once, no mask object and no library call per block. Built once per machine
            with the system's C compiler and loaded with ctypes (which lets go of the GIL while it
            runs); where no compiler is found it is unavailable, with the reason. CPU, fp32 or bf16
            caches. Prompt chunks as ``gather``.

Which one serves by default is measured (:func:`choose_attention`), as chapter 5 picks its engine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from shared.model import Attend, GPT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedInputs:
    """One packed step, flattened (nano-vllm's ``prepare_prefill``/``prepare_decode``, vLLM v1's input batch).

    Sequence ``i`` owns tokens ``query_start[i] .. query_start[i + 1] - 1`` of the row; after the
    step its cache holds ``context_lens[i]`` positions, so its queries sit at positions
    ``context_lens[i] - query_len .. context_lens[i] - 1``. Decoding sequences (one query each)
    come first: ``num_decodes`` of them.
    """

    input_ids: Tensor  # (N,) every token computed this step, sequence after sequence
    positions: Tensor  # (N,) each token's position in its own sequence
    query_start: list[int]  # (S + 1,) cumulative query lengths
    context_lens: list[int]  # (S,) positions cached after this step
    block_tables: list[list[int]]  # (S,) each sequence's blocks, in position order
    slot_mapping: Tensor  # (N,) the pool slot each new key and value is written to
    logits_indices: Tensor  # (R,) the flattened index of each sampling sequence's last token
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]


class PagedAttention:
    """A backend: for each step, :meth:`bind` returns the :data:`shared.model.Attend` the model calls per layer."""

    name = "?"

    def __init__(self, store: PagedKVStore) -> None:
        self.store = store
        config = store.config
        self.heads, self.head_dim = config.n_head, config.head_dim

    def bind(self, inputs: PackedInputs) -> Attend:
        raise NotImplementedError

    def write(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Scatter this step's keys and values, (1, H, N, D) each, into their slots of ``layer``."""
        for kv, new in ((0, k), (1, v)):
            plane = self.store.plane(layer, kv)
            rows = new[0].transpose(0, 1).reshape(new.shape[2], -1)  # (N, H * D): one row per token
            plane.index_copy_(0, slot_mapping, rows.to(plane.dtype))

    def blocks(self, layer: int, kv: int) -> Tensor:
        """One (layer, key/value) plane as one row per block: ``(num_blocks, block_tokens * n_embd)``."""
        plane = self.store.plane(layer, kv)
        return plane.view(-1, self.store.block_tokens * plane.shape[1])


def block_table_tensor(tables: list[list[int]], context_lens: list[int], block_tokens: int, first_block: int) -> Tensor:
    """The rows' block tables as one int32 tensor ``(rows, widest)``, offset to the pool's first block.

    Row ``i`` lists the first ``-(-context_lens[i] // block_tokens)`` blocks of its table (the ones its
    positions lie in), padded with the first block. One flat list, one tensor: a tensor per row cost
    more than the rest of a step's preparation.
    """
    used = [-(-context // block_tokens) for context in context_lens]
    widest = max(used)
    flat: list[int] = []
    for blocks, count in zip(tables, used):
        flat += blocks[:count]
        flat += [0] * (widest - count)
    return torch.tensor(flat, dtype=torch.int32).view(len(used), widest) + first_block


class GatherAttention(PagedAttention):
    """Copy each history out of its blocks into a padded batch, then SDPA (the readable backend)."""

    name = "gather"

    def bind(self, inputs: PackedInputs) -> Attend:
        size, first_block = self.store.block_tokens, self.store.first_block
        decodes = inputs.num_decodes
        plan = _GatherPlan(decodes)
        if decodes:
            # Decode rows: one padded batch. Row r reads blocks table[r] (padded with block 0) and
            # sees key columns < context_lens[r]; the copy is whole blocks, never single slots.
            table = block_table_tensor(inputs.block_tables[:decodes], inputs.context_lens[:decodes], size, first_block)
            widest = table.shape[1]
            lens = torch.tensor(inputs.context_lens[:decodes])
            plan.decode_blocks = table.long().flatten().to(self.store.device)
            plan.decode_mask = (torch.arange(widest * size)[None, :] < lens[:, None])[:, None, None, :].to(self.store.device)
            plan.decode_width = widest * size
        for i in range(decodes, len(inputs.context_lens)):
            start, end = inputs.query_start[i], inputs.query_start[i + 1]
            context = inputs.context_lens[i]
            past = context - (end - start)
            blocks = torch.tensor(inputs.block_tables[i][: -(-context // size)], dtype=torch.long) + first_block
            plan.prompt_chunks.append((start, end, past, blocks.to(self.store.device)))

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.write(layer, k, v, inputs.slot_mapping)
            return self._attend(layer, q, k, v, plan)

        return attend

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, plan: _GatherPlan) -> Tensor:
        heads, head_dim = self.heads, self.head_dim
        out = torch.empty_like(q)
        if plan.decodes:
            keys, values = (self.blocks(layer, kv).index_select(0, plan.decode_blocks)
                            .view(plan.decodes, plan.decode_width, heads, head_dim).transpose(1, 2) for kv in (0, 1))
            queries = q[0, :, : plan.decodes].transpose(0, 1)[:, :, None].to(keys.dtype)  # (S, H, 1, D), the cache's dtype
            y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.decode_mask)
            out[0, :, : plan.decodes] = y[:, :, 0].transpose(0, 1)
        for start, end, past, blocks in plan.prompt_chunks:
            queries = q[:, :, start:end]
            if past == 0:  # the whole history is this chunk: its own keys, no copy
                out[:, :, start:end] = F.scaled_dot_product_attention(queries, k[:, :, start:end], v[:, :, start:end], is_causal=True)
                continue
            context = past + end - start
            keys, values = (self.blocks(layer, kv).index_select(0, blocks).view(1, -1, heads, head_dim)[:, :context]
                            .transpose(1, 2).to(q.dtype) for kv in (0, 1))
            # query j (position past + j) sees keys 0 .. past + j
            mask = torch.arange(context, device=q.device)[None, :] <= torch.arange(past, context, device=q.device)[:, None]
            out[:, :, start:end] = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        return out


@dataclass
class _GatherPlan:
    """What :class:`GatherAttention` computes once per step and every layer reuses."""

    decodes: int
    decode_blocks: Tensor | None = None  # the decode rows' blocks, row after row, padded with block 0
    decode_mask: Tensor | None = None  # (rows, 1, 1, width): True where a key column is the row's own
    decode_width: int = 0
    prompt_chunks: list[tuple[int, int, int, Tensor]] = field(default_factory=list)  # (start, end, past, blocks)


class FlexAttention(GatherAttention):
    """Decode rows through compiled ``flex_attention`` reading the pool in place; prompt chunks as :class:`GatherAttention`.

    Layout (found by measuring the CPU kernel, torch 2.13): each decode row is its own batch element,
    queries ``(B, H, 1, D)`` with B the row count rounded up to a bucket (padding rows list no block
    and are skipped); keys and values are the pool's plane seen as ``(1, H, slots, D)`` without a
    copy (a strided view, broadcast over the batch). The ``BlockMask`` lists, per row, the blocks
    wholly before its position as FULL blocks (no mask evaluated) and the block holding its
    position as the one PARTIAL block, where ``mask_mod`` keeps offsets up to the position's.
    The KV block of the mask must be the pool's block (the kernel's split size), a power of two.

    The mask's tensors and ``mask_mod`` are made once per bucket and overwritten in place each
    step, so the compiled kernel is reused (a new bucket is the only recompile). Torch workarounds:
    ``compute_q_blocks=False`` (a sparse layout; the default builds a dense mask), the index
    tensors as wide as the pool has blocks (the KV length check), ``full_kv_*`` always passed and
    ``PARTITION_SIZE`` huge (the CPU flash-decoding template, picked otherwise for one-token queries,
    splits the whole pool into partitions and fails to compile without full blocks).
    """

    name = "flex"
    KERNEL_OPTIONS = {"PARTITION_SIZE": 1 << 30}
    MIN_BUCKET = 16

    def __init__(self, store: PagedKVStore) -> None:
        super().__init__(store)
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        if limit is not None:  # one compiled version per bucket
            torch._dynamo.config.recompile_limit = max(limit, 32)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        self._flex = torch.compile(flex_attention, dynamic=False)
        self._buckets: dict[int, _FlexBucket] = {}

    @staticmethod
    def unavailable_reason() -> str | None:
        from chapters.ch05_inference_engine.compiled_engine import _compiler_available

        try:
            from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no flex_attention"
        if not _compiler_available():
            return "flex_attention is compiled by torch.compile, which needs a C++ compiler on the CPU (none found on PATH)"
        return None

    def bind(self, inputs: PackedInputs) -> Attend:
        decodes = inputs.num_decodes
        size = self.store.block_tokens
        if size & (size - 1):
            raise ValueError(f"flex attention needs a power-of-two block size, got {size}")
        bucket = None
        if decodes:
            rows = max(self.MIN_BUCKET, 1 << (decodes - 1).bit_length())
            bucket = self._buckets.get(rows)
            if bucket is None:
                bucket = self._buckets[rows] = _FlexBucket(rows, self.store)
            bucket.fill(inputs.block_tables[:decodes], inputs.context_lens[:decodes], self.store.first_block)
        chunks = GatherAttention.bind(self, _without_decodes(inputs))

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if not decodes:
                return chunks(layer, q, k, v)
            self.write(layer, k[:, :, :decodes], v[:, :, :decodes], inputs.slot_mapping[:decodes])
            out = torch.empty_like(q)
            if decodes < q.shape[2]:
                out[:, :, decodes:] = chunks(layer, q[:, :, decodes:], k[:, :, decodes:], v[:, :, decodes:])
            keys, values = (self.store.plane(layer, kv).view(-1, self.heads, self.head_dim).permute(1, 0, 2)[None] for kv in (0, 1))
            queries = keys.new_zeros(bucket.rows, self.heads, 1, self.head_dim)  # in the cache's dtype
            queries[:decodes, :, 0] = q[0, :, :decodes].transpose(0, 1)
            y = self._flex(queries, keys, values, block_mask=bucket.block_mask, kernel_options=self.KERNEL_OPTIONS)
            out[0, :, :decodes] = y[:decodes, :, 0].transpose(0, 1)
            return out

        return attend


class _FlexBucket:
    """The BlockMask of one bucket of ``rows`` decode rows, and the tensors it reads, refilled each step."""

    def __init__(self, rows: int, store: PagedKVStore) -> None:
        from torch.nn.attention.flex_attention import BlockMask

        self.rows = rows
        self.block_size = size = store.block_tokens
        width = store.pool.allocator.total_blocks  # index tensors must cover every block of the pool
        self.partial_count = torch.zeros(rows, 1, 1, dtype=torch.int32)
        self.partial_blocks = torch.zeros(rows, 1, 1, width, dtype=torch.int32)
        self.full_count = torch.zeros(rows, 1, 1, dtype=torch.int32)
        self.full_blocks = torch.zeros(rows, 1, 1, width, dtype=torch.int32)
        self.last_offset = torch.zeros(rows, dtype=torch.int64)  # offset of each row's position in its block
        last_offset, offset_bits = self.last_offset, size - 1

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx & offset_bits) <= last_offset[b]  # only ever applied to a row's last block

        self.block_mask = BlockMask.from_kv_blocks(
            self.partial_count, self.partial_blocks, self.full_count, self.full_blocks,
            BLOCK_SIZE=(1, size), mask_mod=mask_mod, seq_lengths=(1, width * size), compute_q_blocks=False,
        )

    def fill(self, tables: list[list[int]], context_lens: list[int], first_block: int) -> None:
        n, size = len(tables), self.block_size
        table = block_table_tensor(tables, context_lens, size, first_block)
        widest = table.shape[1]
        position = torch.tensor(context_lens, dtype=torch.int64) - 1
        last_block = position // size
        self.full_blocks[:n, 0, 0, :widest] = table
        self.full_count[:n, 0, 0] = last_block.to(torch.int32)
        self.full_count[n:] = 0
        self.partial_blocks[:n, 0, 0, 0] = table.gather(1, last_block[:, None]).squeeze(1)
        self.partial_count[:n] = 1
        self.partial_count[n:] = 0
        self.last_offset[:n] = position % size


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here; the message says why."""


KERNEL_SOURCE = Path(__file__).with_name("paged_decode.c")
KERNEL_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_KERNEL_ARGUMENTS = [_POINTER, _POINTER, _POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _POINTER,
                     _INT, _INT, _INT, _INT, ctypes.c_float, _POINTER, _POINTER, _INT]


def build_kernel(compiler: str | None = None, cache: Path | None = None) -> ctypes.CDLL:
    """``paged_decode.c`` compiled for this machine and loaded; built once, then found in ``cache``.

    The file name carries a digest of the source, the flags, the compiler and the CPU's feature flags
    (``-march=native`` code must not run on another CPU). Raises :class:`KernelUnavailable` with the
    reason when there is no compiler or the build fails.
    """
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or shutil.which(compiler) is None:
        raise KernelUnavailable(f"the kernel backend is built with a C compiler ($CC, cc or gcc), and none was found"
                                f"{f' ({compiler!r})' if compiler else ''}")
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    digest = hashlib.sha256("\0".join([KERNEL_SOURCE.read_text(), *KERNEL_FLAGS, compiler, cpu]).encode()).hexdigest()[:16]
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serving-from-scratch"
    target = cache / f"paged_decode-{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # two servers building at once: each renames its own
        done = subprocess.run([compiler, *KERNEL_FLAGS, "-o", str(partial), str(KERNEL_SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelUnavailable(f"building {KERNEL_SOURCE.name} with {compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    library = ctypes.CDLL(str(target))
    for function in KernelAttention.FUNCTIONS.values():
        getattr(library, function).argtypes = _KERNEL_ARGUMENTS
        getattr(library, function).restype = None
    return library


@functools.cache
def _kernel_library() -> ctypes.CDLL:
    return build_kernel()


class KernelAttention(GatherAttention):
    """Decode rows through ``paged_decode.c`` reading the pool in place; prompt chunks as :class:`GatherAttention`.

    Each step, :meth:`bind` makes the decode rows' block tables one int32 tensor (rows, widest), offset
    to the pool's first block, and their context lengths; each layer then makes ONE kernel call for
    every decode row, which writes the rows' new keys and values into their slots and attends, reading
    the queries, keys and values where the model computed them and writing the output where the
    model's next linear layer reads it (no copy on either side).
    """

    name = "kernel"
    FUNCTIONS = {torch.float32: "paged_decode_fp32", torch.bfloat16: "paged_decode_bf16"}

    def __init__(self, store: PagedKVStore) -> None:
        super().__init__(store)
        dtype = store.pool.storage.dtype
        if store.device.type != "cpu" or dtype not in self.FUNCTIONS:
            raise ValueError(f"the kernel backend runs on the CPU over an fp32 or bf16 cache, not {store.device} {dtype}")
        self._decode = getattr(_kernel_library(), self.FUNCTIONS[dtype])
        self._scratch = torch.empty(self.heads * store.config.n_ctx, dtype=torch.float32)  # one row's scores, every head
        self._scale = 1.0 / math.sqrt(self.head_dim)

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            _kernel_library()
        except KernelUnavailable as error:
            return str(error)
        return None

    def bind(self, inputs: PackedInputs) -> Attend:
        decodes, size = inputs.num_decodes, self.store.block_tokens
        chunks = GatherAttention.bind(self, _without_decodes(inputs))
        if not decodes:
            return chunks
        lens = inputs.context_lens[:decodes]
        tables = block_table_tensor(inputs.block_tables[:decodes], lens, size, self.store.first_block)
        widest, lens_tensor = tables.shape[1], torch.tensor(lens, dtype=torch.int32)
        slots = inputs.slot_mapping[:decodes].to(torch.int64).contiguous()

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            tokens, dtype = q.shape[2], q.dtype
            # (1, N, H, D) in memory, returned as (1, H, N, D): the caller's transpose back is free.
            out = torch.empty(1, tokens, self.heads, self.head_dim, dtype=torch.float32).transpose(1, 2)
            if decodes < tokens:
                out[:, :, decodes:] = chunks(layer, q[:, :, decodes:], k[:, :, decodes:], v[:, :, decodes:])
            if dtype != torch.float32 or not (q.stride() == k.stride() == v.stride() and q.stride(3) == 1):
                q, k, v = (t.to(torch.float32).contiguous() for t in (q, k, v))
            keys, values = self.store.plane(layer, 0), self.store.plane(layer, 1)
            self._decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(2), q.stride(1), slots.data_ptr(),
                         keys.data_ptr(), values.data_ptr(), tables.data_ptr(), widest, lens_tensor.data_ptr(),
                         decodes, self.heads, self.head_dim, size, self._scale, self._scratch.data_ptr(),
                         out.data_ptr(), out.stride(2))
            return out.to(dtype)

        return attend


def _without_decodes(inputs: PackedInputs) -> PackedInputs:
    """``inputs`` with the decode rows taken out (the prompt chunks' tokens renumbered from 0)."""
    d = inputs.num_decodes
    return PackedInputs(
        input_ids=inputs.input_ids[d:], positions=inputs.positions[d:],
        query_start=[start - d for start in inputs.query_start[d:]], context_lens=inputs.context_lens[d:],
        block_tables=inputs.block_tables[d:], slot_mapping=inputs.slot_mapping[d:],
        logits_indices=inputs.logits_indices, num_decodes=0,
    )


BACKENDS: dict[str, Callable[[PagedKVStore], PagedAttention]] = {
    "gather": GatherAttention, "flex": FlexAttention, "kernel": KernelAttention,
}
ATTENTION_CHOICES = Literal["auto", "gather", "flex", "kernel"]

RULE = (
    "Time one packed decode step of the model (max_num_seqs sequences, their contexts spread evenly over "
    "PROBE_CONTEXTS as served traffic spreads them, blocks scattered over the pool) with every backend that "
    "can run here, taking turns for PROBE_REPEATS rounds, median per backend; serve the fastest if it beats "
    "gather by MIN_SPEEDUP, else gather (the readable one)."
)
# Contexts of one length would hide what padding costs gather: the probe's rows differ, as requests do.
PROBE_CONTEXTS, PROBE_REPEATS, MIN_SPEEDUP = (32, 256), 7, 1.10


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run here, or None."""
    if name not in BACKENDS:
        return f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}"
    reason = getattr(BACKENDS[name], "unavailable_reason", None)
    return reason() if reason else None


def choose_attention(name: str, store: PagedKVStore, model: GPT, max_num_seqs: int) -> PagedAttention:
    """The backend ``name`` names, or for ``auto`` the one :data:`RULE` picks on this machine; warmed up.

    Warm-up runs a decode step of every batch size bucket up to ``max_num_seqs`` (16, 32, 64, ...),
    so a compiled backend compiles now, not under the first requests.
    """
    if name != "auto":
        reason = unavailable_reason(name)
        if reason:
            raise ValueError(f"--attention {name}: {reason}")
        chosen = BACKENDS[name](store)
    else:
        chosen = _by_the_rule(store, model, max_num_seqs)
    rows = 1
    while rows < max_num_seqs:
        rows *= 2
        measure_decode_step(model, store, chosen, min(rows, max_num_seqs), repeats=0)
    return chosen


def _by_the_rule(store: PagedKVStore, model: GPT, max_num_seqs: int) -> PagedAttention:
    candidates = {}
    for candidate in BACKENDS:
        reason = unavailable_reason(candidate)
        if reason:
            log.warning("attention %s cannot run here: %s", candidate, reason)
            continue
        try:
            candidates[candidate] = BACKENDS[candidate](store)
        except ValueError as error:  # e.g. the kernel on a GPU pool
            log.warning("attention %s cannot run here: %s", candidate, error)
    if len(candidates) == 1:
        return candidates["gather"]
    timings = measure_decode_steps(model, store, candidates, max_num_seqs)
    best = min(timings, key=timings.get)
    chosen = best if timings[best] * MIN_SPEEDUP <= timings["gather"] else "gather"
    log.info("attention %s, by the rule over: %s", chosen, ", ".join(f"{n} {t * 1e3:.1f} ms/step" for n, t in timings.items()))
    return candidates[chosen]


def measure_decode_step(model: GPT, store: PagedKVStore, backend: PagedAttention, sequences: int, repeats: int = PROBE_REPEATS) -> float:
    """Seconds for one packed decode step of ``sequences`` rows through ``backend`` (see :func:`measure_decode_steps`)."""
    return measure_decode_steps(model, store, {backend.name: backend}, sequences, repeats)[backend.name]


def scattered_decode_inputs(store: PagedKVStore, seq_ids: list, contexts: list[int], rng: random.Random) -> PackedInputs:
    """One packed decode step of ``seq_ids``, whose histories hold ``contexts`` positions (the new token's included).

    Takes their blocks from ``store`` (the caller frees them) and shuffles each row's table, as a busy
    pool scatters blocks: real tables are not runs of consecutive blocks. The probe, the attention
    benchmark and the tests build their steps here.
    """
    manager, size, device = store.manager, store.block_tokens, store.device
    for seq_id, context in zip(seq_ids, contexts):
        manager.allocate(seq_id, context)
    tables = [list(manager.tables[seq_id]) for seq_id in seq_ids]
    for table in tables:
        rng.shuffle(table)
    slots = [(store.first_block + table[(context - 1) // size]) * size + (context - 1) % size
             for table, context in zip(tables, contexts)]
    rows = len(seq_ids)
    return PackedInputs(
        input_ids=torch.zeros(rows, dtype=torch.long, device=device),
        positions=torch.tensor([context - 1 for context in contexts], dtype=torch.long, device=device),
        query_start=list(range(rows + 1)), context_lens=list(contexts), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        logits_indices=torch.arange(rows, device=device), num_decodes=rows,
    )


def measure_decode_steps(model: GPT, store: PagedKVStore, backends: dict[str, PagedAttention], sequences: int,
                         repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Median seconds of one packed decode step of ``sequences`` rows through each backend (the rule's probe).

    The backends take turns, one step each per round, after one unmeasured step each (compilation,
    first touch): a machine that slows down for a moment slows every candidate's round alike, instead
    of all the samples of one of them. The probe's sequences take blocks from the store, scattered as a
    busy pool scatters them, and give them back before this returns.
    """
    manager, rng = store.manager, random.Random(0)
    shortest, longest = min(PROBE_CONTEXTS[0], store.config.n_ctx), min(PROBE_CONTEXTS[1], store.config.n_ctx)
    sequences = max(1, min(sequences, manager.free_blocks // manager.blocks_for(longest)))
    contexts = [shortest + (longest - shortest) * i // max(1, sequences - 1) for i in range(sequences)]
    ids = [("attention-probe", i) for i in range(sequences)]
    inputs = scattered_decode_inputs(store, ids, contexts, rng)
    try:
        steps = {name: (lambda backend=backend: model.forward_packed(inputs.input_ids, inputs.positions, backend.bind(inputs),
                                                                     inputs.logits_indices))
                 for name, backend in backends.items()}
        for step in steps.values():
            step()
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                started = time.perf_counter()
                step()
                samples[name].append(time.perf_counter() - started)
        return {name: sorted(times)[len(times) // 2] if times else 0.0 for name, times in samples.items()}
    finally:
        for seq_id in ids:
            manager.free(seq_id)


def build_attention(name: str, store: PagedKVStore) -> PagedAttention:
    """Backend ``name`` (not ``auto``) over ``store``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(BACKENDS)}")
    return BACKENDS[name](store)
