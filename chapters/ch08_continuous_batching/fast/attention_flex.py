"""The ``flex`` backend: decode rows through compiled :func:`torch.nn.attention.flex_attention` over a ``BlockMask`` built from
the block tables, reading the pool in place. Needs ``torch.compile`` and a C++ compiler (else unavailable, with the reason)."""

from __future__ import annotations

import torch
from torch import Tensor

from chapters.ch08_continuous_batching.paged_attention import DecodeAttend, PackedInputs, PagedAttention, block_table_tensor
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.fast.startup_cache import use_cache_for_compilers


class FlexAttention(PagedAttention):
    """Each decode row its own batch element: queries ``(B, H, 1, D)``, B rounded up to a bucket (padding rows list no block);
    keys and values the pool's plane viewed as ``(1, H_kv, slots, D)``. A row's mask: the blocks before its position FULL, the one
    holding it PARTIAL, rewritten in place each step so a bucket compiles once. For torch: a power-of-two block, index tensors
    as wide as the pool, ``full_kv_*`` always passed, a huge ``PARTITION_SIZE`` (else the CPU template fails to compile)."""

    name = "flex"
    KERNEL_OPTIONS = {"PARTITION_SIZE": 1 << 30}
    MIN_BUCKET = 16

    def __init__(self, store: PagedKVStore) -> None:
        super().__init__(store)
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention
        size = store.block_tokens
        if size & (size - 1):
            raise ValueError(f"flex attention needs a power-of-two block size, got {size}")
        if store.device.type == "cpu":
            from torch._inductor.cpu_vec_isa import pick_vec_isa
            if not pick_vec_isa():  # torch's C++ flex template calls vector helpers it has no scalar form of
                raise ValueError("flex attention on the CPU is compiled with vector instructions (AVX2, AVX-512, NEON, ...) "
                                 "and torch finds none it can use here")
        use_cache_for_compilers()  # TorchInductor's kernels where every process on this machine finds them
        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        if limit is not None:  # one compiled version per bucket
            torch._dynamo.config.recompile_limit = max(limit, 32)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        self._flex = torch.compile(flex_attention, dynamic=False)
        self._buckets: dict[int, _FlexBucket] = {}

    @staticmethod
    def unavailable_reason() -> str | None:
        from chapters.ch05_inference_engine.compiled_engine import compiler_available
        try:
            from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no flex_attention"
        if not compiler_available():
            return "flex_attention is compiled by torch.compile, which needs a C++ compiler on the CPU (none found on PATH)"
        return None

    @classmethod
    def bucket_rows(cls, rows: int) -> int:
        """The decode rows of the bucket that holds ``rows``: a power of two, at least MIN_BUCKET."""
        return max(cls.MIN_BUCKET, 1 << (rows - 1).bit_length())

    def fill_mask(self, tables: list[list[int]], context_lens: list[int]) -> _FlexBucket:
        """The BlockMask of the bucket that holds these decode rows, rewritten in place for their block tables."""
        size = self.bucket_rows(len(tables))
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _FlexBucket(size, self.store)
        bucket.fill(tables, context_lens, self.store.first_block)
        return bucket

    def bind_decodes(self, inputs: PackedInputs) -> DecodeAttend:
        rows = inputs.num_decodes
        bucket = self.fill_mask(inputs.block_tables[:rows], inputs.context_lens[:rows])
        slots = inputs.slot_mapping[:rows]
        options = self.KERNEL_OPTIONS if self.store.device.type == "cpu" else None  # CPU template options only

        def decode(layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
            self.write(layer, k, v, slots)
            keys, values = (self.store.plane(layer, kv).view(-1, self.kv_heads, self.head_dim).permute(1, 0, 2)[None] for kv in (0, 1))
            queries = keys.new_zeros(bucket.rows, self.heads, 1, self.head_dim)  # in the cache's dtype
            queries[:rows, :, 0] = q[0].transpose(0, 1)
            y = self._flex(queries, keys, values, block_mask=bucket.block_mask, kernel_options=options, enable_gqa=self.grouped)
            out[0] = y[:rows, :, 0].transpose(0, 1)
        return decode


class _FlexBucket:
    """The BlockMask of one bucket of ``rows`` decode rows, and the tensors it reads, refilled each step."""

    def __init__(self, rows: int, store: PagedKVStore) -> None:
        from torch.nn.attention.flex_attention import BlockMask
        self.rows = rows
        self.block_size = size = store.block_tokens
        width = store.pool.allocator.total_blocks  # index tensors must cover every block of the pool
        ints = {"dtype": torch.int32, "device": store.device}
        self.partial_count, self.full_count = torch.zeros(rows, 1, 1, **ints), torch.zeros(rows, 1, 1, **ints)
        self.partial_blocks, self.full_blocks = torch.zeros(rows, 1, 1, width, **ints), torch.zeros(rows, 1, 1, width, **ints)
        self.last_offset = torch.zeros(rows, dtype=torch.int64, device=store.device)  # each row's position's offset in its block
        last_offset, offset_bits = self.last_offset, size - 1

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx & offset_bits) <= last_offset[b]  # only ever applied to a row's last block

        q_block = 1 if store.device.type == "cpu" else 128  # Triton's decode kernel tiles 16+ query rows; a row is one block
        self.block_mask = BlockMask.from_kv_blocks(
            self.partial_count, self.partial_blocks, self.full_count, self.full_blocks,
            BLOCK_SIZE=(q_block, size), mask_mod=mask_mod, seq_lengths=(1, width * size), compute_q_blocks=False,
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
