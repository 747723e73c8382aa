"""The scheduler's plan becomes ONE packed model call (nano-vllm's ``model_runner.py``, vLLM v1's input batch).

The plan is plain data: rows of "``length`` tokens of this sequence from position ``start``", decodes first::

    sequence    A (decode)  B (decode)  C (prompt chunk, positions 0-3)  D (chunk, positions 16-18)
    input_ids   [a9]        [b4]        [c0 c1 c2 c3]                     [d16 d17 d18]
    positions   [ 9]        [ 4]        [ 0  1  2  3]                     [ 16  17  18]
    query_start 0           1           2                                 6                 9
    logits_indices [0, 1, 5, 8]: the last token of each row that samples (D's chunk ends before its prompt does)

No padding: the linear layers compute exactly N = 9 tokens and only sampling rows reach the output layer.
Attention gets the layout through :class:`~chapters.ch08_continuous_batching.paged_attention.PagedAttention`.
The model is chapter 5's engine, called through :meth:`shared.model.DecoderModel.forward_packed`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Rows
from typing import Protocol

import torch
from torch import Tensor

from chapters.ch05_inference_engine.engine import Engine, EngineUnavailable, TorchModuleEngine
from chapters.ch08_continuous_batching.paged_attention import PackedInputs, PagedAttention
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ScheduledRow
from shared.model import Attend, DecoderModel


class PackedModel(Protocol):
    """A model that computes a packed step: :meth:`shared.model.DecoderModel.forward_packed`'s signature."""

    def forward_packed(self, input_ids: Tensor, position_ids: Tensor, attend: Attend, logits_indices: Tensor) -> Tensor: ...


def runs_packed_steps(engine: Engine) -> bool:
    """Whether :func:`packed_model` can take ``engine``."""
    return isinstance(engine, TorchModuleEngine) and isinstance(getattr(engine.module, "_orig_mod", engine.module), DecoderModel)


def packed_model(engine: Engine) -> DecoderModel:
    """The module of chapter 5's ``engine`` that runs packed steps: an eager, int8 or bf16-matmul decoder (GPT or
    Llama); EngineUnavailable for an engine whose forward is an exported or recorded graph."""
    if not runs_packed_steps(engine):
        raise EngineUnavailable(f"{engine.label}: chapter 8's packed step needs a PyTorch-module engine (eager, int8, bf16)")
    return getattr(engine.module, "_orig_mod", engine.module)


def pack_rows(rows: Rows[ScheduledRow]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The flattened layout of ``rows``: ``(input_ids, positions, query_start, logits_indices)``. Row ``i`` owns tokens
    ``query_start[i] .. query_start[i + 1] - 1``; ``logits_indices``, the index of the last token of each row that samples."""
    # EXERCISE ch08.4 BEGIN "packed inputs: flatten the rows into ids, positions, cumulative lengths, logits indices"
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    logits_indices: list[int] = []
    for row in rows:
        input_ids += row.new_ids
        positions += range(row.start, row.start + len(row.new_ids))
        query_start.append(len(input_ids))
        if row.samples:
            logits_indices.append(len(input_ids) - 1)
    return input_ids, positions, query_start, logits_indices


def prepare_inputs(store: PagedKVStore, rows: Rows[ScheduledRow], num_decodes: int) -> PackedInputs:
    """The step's tensors (:func:`pack_rows`, plus the slot mapping and the block tables); every row's
    block table must already cover what it writes."""
    input_ids, positions, query_start, logits_indices = pack_rows(rows)
    slots: list[int] = []
    for row in rows:
        slots += store.slots(row.seq.seq_id, row.start, row.start + len(row.new_ids))
    to_device = lambda values: torch.tensor(values, dtype=torch.long).to(store.device)  # noqa: E731
    return PackedInputs(
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        query_start=query_start,
        context_lens=[row.start + len(row.new_ids) for row in rows],
        block_tables=[store.manager.tables[row.seq.seq_id] for row in rows],
        slot_mapping=to_device(slots),
        logits_indices=to_device(logits_indices),
        num_decodes=num_decodes,
    )


class ModelRunner:
    """Prepares and runs one packed step; keeps how long each half took (``last_prepare_s``, ``last_model_s``)."""

    def __init__(self, model: PackedModel, store: PagedKVStore, attention: PagedAttention) -> None:
        self.model, self.store, self.attention = model, store, attention
        self.last_prepare_s = self.last_model_s = 0.0

    def execute(self, rows: Rows[ScheduledRow], num_decodes: int) -> Tensor:
        """float32 logits (R, V) of the rows that sample, in row order (an empty (0, V) when none does)."""
        started = time.perf_counter()
        inputs = prepare_inputs(self.store, rows, num_decodes)
        attend = self.attention.bind(inputs)
        prepared = time.perf_counter()
        logits = self.model.forward_packed(inputs.input_ids, inputs.positions, attend, inputs.logits_indices)
        self.last_prepare_s, self.last_model_s = prepared - started, time.perf_counter() - prepared
        return logits
