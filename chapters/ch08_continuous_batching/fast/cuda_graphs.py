"""Decode steps replayed from CUDA graphs, one per bucket of rows (flex's buckets: only its mask tensors are static per bucket),
padded to the bucket in static buffers: padding rows take token 0 at position 0, write a scratch slot no sequence owns, and attend
to no block. A step with a prompt chunk, or more rows than the largest bucket, runs eagerly; ``capture=False`` never records."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Rows

import torch
from torch import Tensor

from chapters.ch08_continuous_batching.fast.attention_flex import FlexAttention
from chapters.ch08_continuous_batching.model_runner import ModelRunner, PackedModel, pack_rows
from chapters.ch08_continuous_batching.paged_attention import PackedInputs, PagedAttention
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ScheduledRow
from shared.settings import SettingsError

log = logging.getLogger(__name__)
PADDING_SEQUENCE = "padding rows of recorded steps"  # the block table that owns the scratch slot


class GraphedDecodes:
    """Decode-only steps of up to ``max_rows`` rows through one recorded (``capture``) or static step per bucket."""

    def __init__(self, model: PackedModel, store: PagedKVStore, attention: FlexAttention, max_rows: int, capture: bool) -> None:
        if not isinstance(attention, FlexAttention):
            raise ValueError(f"recorded decode steps need the flex attention backend, not {attention.name}")
        if capture and store.device.type != "cuda":
            raise ValueError("recording decode steps needs CUDA; this pool is on the CPU")
        self.model, self.store, self.attention = model, store, attention
        self.buckets = [attention.bucket_rows(1)]
        while self.buckets[-1] < max_rows:
            self.buckets.append(self.buckets[-1] * 2)
        store.manager.allocate(PADDING_SEQUENCE, 1)
        self.scratch_slot = store.slots(PADDING_SEQUENCE, 0, 1)[0]
        largest, device = self.buckets[-1], store.device
        self.static = torch.zeros((3, largest), dtype=torch.long, device=device)  # ids, positions, slots
        self.logits_indices = torch.arange(largest, device=device)
        self._steps = {bucket: self._bind(bucket) for bucket in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Tensor] = {}
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory
                self._graphs[bucket], self._outputs[bucket] = self._record(bucket, pool)

    def holds(self, num_rows: int, num_decodes: int) -> bool:
        """Whether a step of ``num_rows`` rows, ``num_decodes`` of them decodes, runs here."""
        return num_decodes == num_rows <= self.buckets[-1]

    def prepare(self, rows: Rows[ScheduledRow]) -> int:
        """Write the step's inputs into the static buffers and the bucket's mask; the bucket's row count."""
        ids, positions, _, _ = pack_rows(rows)
        slots = [self.store.slots(row.seq.seq_id, row.start, row.start + 1)[0] for row in rows]
        bucket, padding = self.attention.bucket_rows(len(rows)), self.attention.bucket_rows(len(rows)) - len(rows)
        staged = torch.tensor([ids + [0] * padding, positions + [0] * padding, slots + [self.scratch_slot] * padding])
        self.static[:, :bucket].copy_(staged)
        self.attention.fill_mask([self.store.manager.tables[row.seq.seq_id] for row in rows], [row.start + 1 for row in rows])
        return bucket

    def run(self, bucket: int, num_rows: int) -> Tensor:
        """float32 logits of the first ``num_rows`` rows after :meth:`prepare`; a copy (the next step overwrites)."""
        if bucket in self._graphs:
            self._graphs[bucket].replay()
            return self._outputs[bucket][:num_rows].clone()
        return self._steps[bucket]()[:num_rows]

    def _bind(self, bucket: int):
        """The static step of ``bucket`` rows: the model over the static buffers, attention bound once to them."""
        ids, positions, slots = (self.static[i, :bucket] for i in range(3))
        scratch_block = self.store.manager.tables[PADDING_SEQUENCE]
        inputs = PackedInputs(input_ids=ids, positions=positions, query_start=list(range(bucket + 1)),
                              context_lens=[1] * bucket, block_tables=[scratch_block] * bucket, slot_mapping=slots,
                              logits_indices=self.logits_indices[:bucket], num_decodes=bucket)
        attend = self.attention.bind(inputs)  # its closures read the static buffers and the bucket's mask tensors
        return lambda: self.model.forward_packed(ids, positions, attend, inputs.logits_indices)

    def _record(self, bucket: int, pool: object) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        step = self._steps[bucket]
        step()  # compiles the bucket's attention if it has not been, and lets the allocator settle
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = step()
        return graph, output


class GraphedModelRunner(ModelRunner):
    """The core's runner, with the decode-only steps :class:`GraphedDecodes` holds replayed instead of launched."""

    def __init__(self, model: PackedModel, store: PagedKVStore, attention: PagedAttention, graphs: GraphedDecodes) -> None:
        super().__init__(model, store, attention)
        self.graphs = graphs

    def execute(self, rows: Rows[ScheduledRow], num_decodes: int) -> Tensor:
        if not self.graphs.holds(len(rows), num_decodes):
            return super().execute(rows, num_decodes)
        started = time.perf_counter()
        bucket = self.graphs.prepare(rows)
        prepared = time.perf_counter()
        logits = self.graphs.run(bucket, len(rows))
        self.last_prepare_s, self.last_model_s = prepared - started, time.perf_counter() - prepared
        return logits


def model_runner(setting: str, model: PackedModel, store: PagedKVStore, attention: PagedAttention, max_rows: int) -> ModelRunner:
    """The ``--cuda-graphs`` setting applied: a runner with recorded decode steps, or the core's. ``auto``: recorded where the
    pool is on a GPU and the attention is ``flex``; ``on`` where that does not hold raises SettingsError with the reason."""
    possible = store.device.type == "cuda" and isinstance(attention, FlexAttention)
    if setting == "off" or (setting == "auto" and not possible):
        return ModelRunner(model, store, attention)
    if not possible:
        raise SettingsError(f"--cuda-graphs on needs the pool on a GPU and the flex attention backend; here: the pool on "
                            f"{store.device.type}, attention {attention.name}")
    started = time.perf_counter()
    graphs = GraphedDecodes(model, store, attention, max_rows, capture=True)
    log.info("cuda graphs: decode steps of %s rows recorded in %.1f s", ", ".join(map(str, graphs.buckets)),
             time.perf_counter() - started)
    return GraphedModelRunner(model, store, attention, graphs)
