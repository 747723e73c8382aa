"""The ``gather`` backend, plain PyTorch: each decode row's blocks copied out of the pool into a padded batch,
then SDPA with a mask over the padding. The copy is its price: every step reads each history, writes it again
and reads the copy (the fast path's backends read the pool in place: ``fast/``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from chapters.ch08_continuous_batching.paged_attention import DecodeAttend, PackedInputs, PagedAttention, block_table_tensor


class GatherAttention(PagedAttention):
    """Copy each decode row's history out of its blocks into a padded batch, then SDPA (its key/value heads
    only: SDPA's ``enable_gqa`` lets each group of query heads read its key/value head where it lies)."""

    name = "gather"

    def bind_decodes(self, inputs: PackedInputs) -> DecodeAttend:
        rows, size, device = inputs.num_decodes, self.store.block_tokens, self.store.device
        # Row r reads blocks table[r] (padded with the first block) and sees key columns < context_lens[r].
        table = block_table_tensor(inputs.block_tables[:rows], inputs.context_lens[:rows], size, self.store.first_block)
        width = table.shape[1] * size
        lens = torch.tensor(inputs.context_lens[:rows])
        blocks = table.long().flatten().to(device)
        mask = (torch.arange(width)[None, :] < lens[:, None])[:, None, None, :].to(device)  # (rows, 1, 1, width)
        slots = inputs.slot_mapping[:rows]

        def decode(layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
            self.write(layer, k, v, slots)
            keys, values = (self.blocks(layer, kv).index_select(0, blocks)
                            .view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2) for kv in (0, 1))
            queries = q[0].transpose(0, 1)[:, :, None].to(keys.dtype)  # (rows, H, 1, D), the cache's dtype
            y = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=self.grouped)
            out[0] = y[:, :, 0].transpose(0, 1)

        return decode
