"""The ``kernel`` backend: every token of a step, one row each, through the C kernel ``paged_decode.c`` beside this file, which
writes their keys and values, then attends, reading the pool in place. CPU only, fp32 or bf16 caches; built once per machine
with the system's C compiler (else unavailable, with the reason), loaded with ctypes, which releases the GIL while it runs."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from pathlib import Path

import torch
from torch import Tensor

from chapters.ch05_inference_engine.native_library import NativeBuildFailed, build_library, library_path
from chapters.ch08_continuous_batching.paged_attention import DecodeAttend, PackedInputs, PagedAttention, block_table_tensor
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.fast.startup_cache import cache_dir
from shared.model import Attend

KERNEL_SOURCE = Path(__file__).with_name("paged_decode.c")
KERNEL_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")
KERNEL_FUNCTIONS = {torch.float32: "paged_decode_fp32", torch.bfloat16: "paged_decode_bf16"}
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
KERNEL_ARGUMENTS = [_POINTER, _POINTER, _POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _POINTER,
                    _INT, _INT, _INT, _INT, _INT, ctypes.c_float, _POINTER, _POINTER, _INT]  # paged_decode.c's signature


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here; the message says why."""


def kernel_target(compiler: str, cache: Path) -> Path:
    """Where ``compiler``'s build lives in ``cache``: named for a digest of the source, flags, compiler and every CPU flag."""
    return library_path(KERNEL_SOURCE, KERNEL_FLAGS, compiler, cache)


def build_kernel(compiler: str | None = None, cache: Path | None = None) -> ctypes.CDLL:
    """``paged_decode.c`` compiled for this machine and loaded (chapter 5's :func:`build_library`), built once into
    :func:`kernel_target` under ``cache`` (default: :func:`cache_dir`, shared by every process here);
    :class:`KernelUnavailable` with the reason without a compiler or a build."""
    signatures = {function: KERNEL_ARGUMENTS for function in KERNEL_FUNCTIONS.values()}
    try:
        return build_library(KERNEL_SOURCE, KERNEL_FLAGS, signatures, cache or cache_dir(), compiler)
    except NativeBuildFailed as error:
        raise KernelUnavailable(f"the kernel backend: {error}") from error


@functools.cache
def _kernel_library() -> ctypes.CDLL:
    return build_kernel()


def scores_scratch(heads: int, longest: int) -> Tensor:
    """The kernel's ``logits`` scratch for a row of up to ``longest`` positions: every head's scores, padded to 16 floats."""
    return torch.empty(heads * (longest + 16), dtype=torch.float32)


class KernelAttention(PagedAttention):
    """Every token of a step through ``paged_decode.c``, ONE call per layer reading queries, keys and values where the model put
    them and writing where its next layer reads (no copy where they share token and head strides; else fp32 copies)."""

    name = "kernel"

    def __init__(self, store: PagedKVStore) -> None:
        super().__init__(store)
        dtype = store.pool.storage.dtype
        if store.device.type != "cpu" or dtype not in KERNEL_FUNCTIONS:
            raise ValueError(f"the kernel backend runs on the CPU over an fp32 or bf16 cache, not {store.device} {dtype}")
        self._decode = getattr(_kernel_library(), KERNEL_FUNCTIONS[dtype])
        self._scratch, self._scale = scores_scratch(self.heads, store.config.n_ctx), 1.0 / math.sqrt(self.head_dim)

    @staticmethod
    def unavailable_reason() -> str | None:
        try:
            _kernel_library()
        except KernelUnavailable as error:
            return str(error)
        return None

    def bind(self, inputs: PackedInputs) -> Attend:
        """The step with every token a row: a chunk's token at position ``p`` attends to ``0 .. p`` as a decode row does (the
        kernel writes every row's key and value before any row reads), sharing its chunk's block table, with no mask or copy."""
        counts = [end - start for start, end in zip(inputs.query_start, inputs.query_start[1:])]
        return super().bind(dataclasses.replace(
            inputs, query_start=list(range(sum(counts) + 1)), num_decodes=sum(counts),
            context_lens=[p for context, n in zip(inputs.context_lens, counts) for p in range(context - n + 1, context + 1)],
            block_tables=[table for table, n in zip(inputs.block_tables, counts) for _ in range(n)]))

    def empty_output(self, q: Tensor) -> Tensor:
        # fp32, (1, N, H, D) in memory, returned as (1, H, N, D): the caller's transpose back is free.
        return torch.empty(1, q.shape[2], self.heads, self.head_dim, dtype=torch.float32).transpose(1, 2)

    def bind_decodes(self, inputs: PackedInputs) -> DecodeAttend:
        rows, size = inputs.num_decodes, self.store.block_tokens
        lens = inputs.context_lens[:rows]
        tables = block_table_tensor(inputs.block_tables[:rows], lens, size, self.store.first_block)
        lens_tensor, slots = torch.tensor(lens, dtype=torch.int32), inputs.slot_mapping[:rows].to(torch.int64).contiguous()

        def decode(layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
            if q.dtype != torch.float32 or not (q.stride()[1:] == k.stride()[1:] == v.stride()[1:] and q.stride(3) == 1):
                q, k, v = (t.to(torch.float32).contiguous() for t in (q, k, v))
            keys, values = self.store.plane(layer, 0), self.store.plane(layer, 1)
            self._decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(2), q.stride(1), slots.data_ptr(),
                         keys.data_ptr(), values.data_ptr(), tables.data_ptr(), tables.shape[1], lens_tensor.data_ptr(),
                         rows, self.heads, self.kv_heads, self.head_dim, size, self._scale, self._scratch.data_ptr(),
                         out.data_ptr(), out.stride(2))
        return decode
