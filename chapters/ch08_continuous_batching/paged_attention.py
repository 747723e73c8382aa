"""Attention that reads the paged cache where it lies: the seam between a packed step and the pool.

A packed step hands the model ONE row of every token it computes. Attention is the one layer where sequences must not mix:
token ``j`` of sequence ``i`` reads sequence ``i``'s keys at positions ``0 .. p_j`` only. So each layer's attention gets the
step's layout (:class:`PackedInputs`, nano-vllm's ``Context``) and (1) writes the step's new keys and values into their pool
slots (the slot mapping), (2) lets each query read its own sequence's keys and values through its block table. The pool holds
the key/value heads only; under grouped-query attention query head ``h`` reads key/value head ``h // (heads / kv_heads)`` in
place. Prompt chunks are attended here, the same way by every backend. A backend (:class:`PagedAttention`'s subclasses; the
core's is ``attention_gather``) decides only how the DECODE rows read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from shared.model import Attend

# What a backend's bind_decodes returns: decode(layer, q, k, v, out) for the decode rows' slices.
DecodeAttend = Callable[[int, Tensor, Tensor, Tensor, Tensor], None]


@dataclass(frozen=True)
class PackedInputs:
    """One packed step, flattened (nano-vllm's ``prepare_prefill``/``prepare_decode``, vLLM v1's input batch).

    Sequence ``i`` owns tokens ``query_start[i] .. query_start[i + 1] - 1`` of the row; after the step its cache holds
    ``context_lens[i]`` positions, so its queries sit at positions ``context_lens[i] - query_len .. context_lens[i] - 1``.
    Decoding sequences (one query each) come first: ``num_decodes`` of them.
    """

    input_ids: Tensor  # (N,) every token computed this step, sequence after sequence
    positions: Tensor  # (N,) each token's position in its own sequence
    query_start: list[int]  # (S + 1,) cumulative query lengths (cu_seqlens)
    context_lens: list[int]  # (S,) positions cached after this step
    block_tables: list[list[int]]  # (S,) each sequence's blocks, in position order
    slot_mapping: Tensor  # (N,) the pool slot each new key and value is written to
    logits_indices: Tensor  # (R,) the flattened index of each sampling sequence's last token
    num_decodes: int


def block_table_tensor(tables: list[list[int]], context_lens: list[int], block_tokens: int, first_block: int) -> Tensor:
    """The rows' block tables as one int32 tensor ``(rows, widest)``, offset to the pool's first block: row ``i`` lists
    the blocks its ``context_lens[i]`` positions lie in, padded with the first block (built from one flat list)."""
    used = [-(-context // block_tokens) for context in context_lens]
    widest = max(used)
    flat: list[int] = []
    for blocks, count in zip(tables, used):
        flat += blocks[:count]
        flat += [0] * (widest - count)
    return torch.tensor(flat, dtype=torch.int32).view(len(used), widest) + first_block


class PagedAttention:
    """A backend: for each step, :meth:`bind` returns the :data:`shared.model.Attend` the model calls per layer.

    A subclass says how its decode rows attend (:meth:`bind_decodes`, which also stores their keys and values); the prompt
    chunks are attended here. Queries have ``heads`` heads, keys and values ``kv_heads``."""

    name = "?"

    def __init__(self, store: PagedKVStore) -> None:
        self.store = store
        self.heads, self.kv_heads, self.head_dim = store.config.n_head, store.config.kv_heads, store.config.head_dim
        self.grouped = self.kv_heads != self.heads  # SDPA's enable_gqa only then: some of its kernels lack it

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run on this machine, or None."""
        return None

    def bind_decodes(self, inputs: PackedInputs) -> DecodeAttend:
        """What the decode rows (the first ``inputs.num_decodes``) need each layer, computed once per step."""
        raise NotImplementedError

    def empty_output(self, q: Tensor) -> Tensor:
        """Where a layer's output is written, shaped as ``q``."""
        return torch.empty_like(q)

    def bind(self, inputs: PackedInputs) -> Attend:
        decodes = inputs.num_decodes
        decode = self.bind_decodes(inputs) if decodes else None
        chunks, chunk_slots = self._plan_chunks(inputs), inputs.slot_mapping[decodes:]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = self.empty_output(q)
            if decode is not None:
                decode(layer, q[:, :, :decodes], k[:, :, :decodes], v[:, :, :decodes], out[:, :, :decodes])
            if chunks:
                self.write(layer, k[:, :, decodes:], v[:, :, decodes:], chunk_slots)
                self._attend_chunks(layer, q, k, v, chunks, out)
            return out.to(q.dtype)

        return attend

    def write(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Scatter keys and values, (1, H_kv, N, D) each, into their slots of ``layer``."""
        for kv, new in ((0, k), (1, v)):
            plane = self.store.plane(layer, kv)
            rows = new[0].transpose(0, 1).reshape(new.shape[2], -1)  # (N, H_kv * D): one row per token
            plane.index_copy_(0, slot_mapping, rows.to(plane.dtype))

    def blocks(self, layer: int, kv: int) -> Tensor:
        """One (layer, key/value) plane as one row per block: ``(num_blocks, block_tokens * kv_width)``."""
        plane = self.store.plane(layer, kv)
        return plane.view(-1, self.store.block_tokens * plane.shape[1])

    def _plan_chunks(self, inputs: PackedInputs) -> list[tuple[int, int, int, Tensor]]:
        """Each prompt chunk's (start, end) in the row, its past (positions cached before it) and its blocks."""
        size, first_block, chunks = self.store.block_tokens, self.store.first_block, []
        for i in range(inputs.num_decodes, len(inputs.context_lens)):
            start, end, context = inputs.query_start[i], inputs.query_start[i + 1], inputs.context_lens[i]
            blocks = torch.tensor(inputs.block_tables[i][: -(-context // size)], dtype=torch.long) + first_block
            chunks.append((start, end, context - (end - start), blocks.to(self.store.device)))
        return chunks

    def _attend_chunks(self, layer: int, q: Tensor, k: Tensor, v: Tensor, chunks: list, out: Tensor) -> None:
        for start, end, past, blocks in chunks:
            queries = q[:, :, start:end]
            if past == 0:  # the whole history is this chunk: its own keys, no copy
                out[:, :, start:end] = F.scaled_dot_product_attention(queries, k[:, :, start:end], v[:, :, start:end], is_causal=True,
                                                                      enable_gqa=self.grouped)
                continue
            context = past + end - start
            keys, values = (self.blocks(layer, kv).index_select(0, blocks).view(1, -1, self.kv_heads, self.head_dim)[:, :context]
                            .transpose(1, 2).to(q.dtype) for kv in (0, 1))
            # query j (position past + j) sees keys 0 .. past + j
            mask = torch.arange(context, device=q.device)[None, :] <= torch.arange(past, context, device=q.device)[:, None]
            out[:, :, start:end] = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=self.grouped)
