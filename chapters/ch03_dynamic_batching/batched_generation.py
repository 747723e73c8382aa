"""Greedy generation for a whole batch at once: left padding, an attention mask, positions that count real tokens only."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from chapters.ch02_fastapi_async.api import Generated
from chapters.ch03_dynamic_batching.step_loop import run_until_done
from shared.devices import synchronize
from shared.model import DynamicKVCache, KVCache, ModelConfig, StepModel

# (batch_size, max_seq_len) -> an empty cache for that many rows; it will hold at most max_seq_len positions.
CacheFactory = Callable[[int, int], KVCache]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, position_ids)``, each (B, longest prompt), ``torch.long`` on ``device``, padded on the left:
    row ``i`` ends with prompt ``i``'s ids; the mask is 1 on real tokens, 0 on padding; real tokens at positions 0, 1, ..."""
    # EXERCISE ch03.3 BEGIN "left padding with position ids that count real tokens only"
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, longest - len(prompt):] = 1
    # Real tokens count 0, 1, 2, ...; padding gets 0 (it is masked, any valid index would do).
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def fits_in_context(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], n_ctx: int) -> bool:
    """Padding costs context too: the padded batch spans the longest prompt plus the most new tokens."""
    return max(len(p) for p in prompts) + max(max_new_tokens) <= n_ctx


def split_to_fit(lengths_and_new: Sequence[tuple[int, int]], n_ctx: int) -> list[range]:
    """Cut a batch, in order, into consecutive groups whose padded length fits ``n_ctx`` (each request fits on its own)."""
    groups: list[range] = []
    start, longest_prompt, most_new = 0, 0, 0
    for index, (prompt_len, new_tokens) in enumerate(lengths_and_new):
        longest_prompt, most_new = max(longest_prompt, prompt_len), max(most_new, new_tokens)
        if longest_prompt + most_new > n_ctx:
            groups.append(range(start, index))
            start, longest_prompt, most_new = index, prompt_len, new_tokens
    groups.append(range(start, len(lengths_and_new)))
    return groups


Prefill = Literal["by_length", "padded"]


class StaticBatch:
    """Request-level scheduling for :mod:`~chapters.ch03_dynamic_batching.step_loop`: one batch, fixed at the start.

    A prompt pass (``prefill``: :func:`prefill_by_length` or :func:`prefill_padded`) leaves one left-padded cache, then one
    decode step per token runs for all rows until the longest is done; a finished row is still computed, no longer recorded.
    Raises ValueError unless the padded batch fits the context. :meth:`choose` picks the tokens fed back (greedy)."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        pad_id: int,
        cache: KVCache,
        prefill: Prefill = "by_length",
    ) -> None:
        if len(prompts) != len(max_new_tokens) or not prompts:
            raise ValueError("need one max_new_tokens per prompt, and at least one prompt")
        if not fits_in_context(prompts, max_new_tokens, config.n_ctx):
            raise ValueError(f"the padded batch exceeds the context of {config.n_ctx}; split it first")
        self.prompts, self.max_new_tokens, self.prefill_kind = prompts, max_new_tokens, prefill
        self.steps = max(max_new_tokens)
        self.input_ids, self.attention_mask, self.position_ids = left_pad(prompts, pad_id, device)
        self.padded = bool((self.attention_mask == 0).any())
        self.cache = cache
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.taken = 0  # steps whose tokens have been recorded
        self.started = time.perf_counter()
        self.prefill_ms = 0.0
        self.finished_ms = [0.0] * len(prompts)

    @property
    def done(self) -> bool:
        return self.taken == self.steps

    def schedule(self) -> _PromptPass | _DecodeStep | None:
        if self.done:
            return None
        if self.taken == 0:
            return _PromptPass(self)
        return _DecodeStep(self)

    def choose(self, logits: Tensor) -> Tensor:
        """The ids fed back after this step: greedy."""
        return logits.argmax(dim=-1)

    def update(self, step: _PromptPass | _DecodeStep, logits: Tensor) -> None:
        next_ids = self.choose(logits)
        tokens = next_ids.tolist()  # one device sync per step
        elapsed_ms = (time.perf_counter() - self.started) * 1e3
        if self.taken == 0:
            self.prefill_ms = elapsed_ms
            self.position_ids = self.position_ids[:, -1:]  # from now on: each row's newest position
        for row, token in enumerate(tokens):
            if len(self.outputs[row]) < self.max_new_tokens[row]:
                self.outputs[row].append(token)
                if len(self.outputs[row]) == self.max_new_tokens[row]:
                    self.finished_ms[row] = elapsed_ms
        self.taken += 1
        # What the next decode step feeds: each row's newest token, one position further; the mask grows a column.
        self.input_ids = next_ids[:, None]
        self.position_ids = self.position_ids + 1
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((len(tokens), 1))], dim=1)

    def results(self) -> list[Generated]:
        batch_ms = (time.perf_counter() - self.started) * 1e3
        return [
            Generated(ids, {"prefill": self.prefill_ms, "decode": done - self.prefill_ms, "batch": batch_ms})
            for ids, done in zip(self.outputs, self.finished_ms)
        ]


@dataclass
class _PromptPass:
    batch: StaticBatch

    def execute(self, model: StepModel) -> Tensor:
        b = self.batch
        if b.prefill_kind == "padded":
            return prefill_padded(model, b.input_ids, b.attention_mask if b.padded else None, b.position_ids, b.cache)
        return prefill_by_length(model, b.prompts, b.cache)


@dataclass
class _DecodeStep:
    batch: StaticBatch

    def execute(self, model: StepModel) -> Tensor:
        b = self.batch
        # Without padding the plain causal path is exact and faster: only pass a mask when needed.
        return model.decode(b.input_ids, b.position_ids, b.attention_mask if b.padded else None, b.cache)


@torch.no_grad()
def batched_greedy(
    model: StepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    pad_id: int,
    cache_factory: CacheFactory | None = None,
    prefill: Prefill = "by_length",
) -> list[Generated]:
    """Greedy continuations of every prompt, computed together: row ``i`` gets exactly ``max_new_tokens[i]`` ids, as alone."""
    longest = max((len(p) for p in prompts), default=0)
    # The last token generated is never fed back, so the cache holds the prompt plus steps - 1 positions.
    cache = (cache_factory or _dynamic_cache(model))(len(prompts), longest + max(max_new_tokens, default=1) - 1)
    batch = StaticBatch(model.config, model.device, prompts, max_new_tokens, pad_id, cache, prefill)
    run_until_done(batch, model)
    synchronize(model.device)
    return batch.results()


def prefill_padded(
    model: StepModel, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor, cache: KVCache
) -> Tensor:
    """The textbook prompt pass over the whole left-padded batch, padding computed (masked); each row's last logits (B, V)."""
    return model.prefill(input_ids, position_ids, attention_mask, cache)


def prefill_by_length(model: StepModel, prompts: Sequence[Sequence[int]], cache: KVCache) -> Tensor:
    """The prompt pass without computing any padding; returns each row's last logits (B, V). Prompts of one length run together
    unmasked; their keys and values go into ``cache`` (``update``, ``advance``) left-padded, as if one padded pass wrote them."""
    device, n_layer = model.device, model.config.n_layer
    longest = max(len(p) for p in prompts)
    first_logits: Tensor | None = None
    keys: list[Tensor] = []  # per layer: (B, H, longest, D)
    values: list[Tensor] = []
    for length, rows in _rows_by_length(prompts).items():
        capture = _CapturingCache(n_layer)
        ids = torch.tensor([list(prompts[r]) for r in rows], dtype=torch.long, device=device)
        logits = model.prefill(ids, None, None, capture)
        if first_logits is None:
            first_logits = logits.new_empty((len(prompts), logits.shape[-1]))
        first_logits[rows] = logits
        if not keys:  # the first group tells the shapes: (rows, heads, positions, head size)
            _, heads, _, head_dim = capture.keys[0].shape
            like = capture.keys[0]
            keys = [like.new_zeros((len(prompts), heads, longest, head_dim)) for _ in range(n_layer)]
            values = [like.new_zeros((len(prompts), heads, longest, head_dim)) for _ in range(n_layer)]
        for layer in range(n_layer):
            keys[layer][rows, :, longest - length :] = capture.keys[layer]  # right-aligned: left padding
            values[layer][rows, :, longest - length :] = capture.values[layer]
    for layer in range(n_layer):
        cache.update(layer, keys[layer], values[layer])
    cache.advance(longest)
    return first_logits


def _rows_by_length(prompts: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(row)
    return groups


class _CapturingCache:
    """A stand-in cache for one prompt pass: it keeps what each layer computed, so it can be stitched."""

    def __init__(self, n_layer: int) -> None:
        self.keys: list[Tensor | None] = [None] * n_layer
        self.values: list[Tensor | None] = [None] * n_layer

    @property
    def seq_len(self) -> int:
        return 0  # nothing before the prompt

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def read(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.keys[layer], self.values[layer]

    def advance(self, n_tokens: int) -> None:
        pass


def _dynamic_cache(model: StepModel) -> CacheFactory:
    return lambda batch_size, max_seq_len: DynamicKVCache(model.config.n_layer)


def generate_batch(
    model: StepModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    pad_id: int,
    cache_factory: CacheFactory | None = None,
    prefill: Prefill = "by_length",
) -> list[Generated]:
    """:func:`batched_greedy` for any batch of valid requests, split where the padded batch would not fit."""
    groups = split_to_fit([(len(p), n) for p, n in zip(prompts, max_new_tokens)], model.config.n_ctx)
    outputs: list[Generated] = []
    for group in groups:
        outputs += batched_greedy(
            model, [prompts[i] for i in group], [max_new_tokens[i] for i in group], pad_id, cache_factory, prefill
        )
    return outputs
