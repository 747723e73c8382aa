"""Greedy generation for a whole batch at once: left padding, an attention mask, real-token positions.

Prompts of different lengths are padded ON THE LEFT to the longest one, so every row's last prompt
token sits in the same column and each decode step appends one column for all rows at once:

    row 0:  [pad pad  a   b   c ] -> next token
    row 1:  [ d   e   f   g   h ] -> next token

The attention mask (1 = real token, 0 = padding) keeps padding out of every attention, and the
position ids count real tokens only (row 0's ``a`` is at position 0, not 2), so each row computes
exactly what it would alone and returns the oracle's tokens.

The prompt pass does not even compute the padding (:func:`prefill_by_length`): prompts of equal
length run together unpadded, and their keys and values are stitched into one left-padded cache.
:func:`prefill_padded`, the textbook pass over the padded batch, stays for comparison
(``--prefill padded``): on the benchmark's mix of 16 to 128-token prompts it computes about twice
the prompt tokens there are.

This is **static batching**: the batch enters together and leaves together. A row that asked for
fewer tokens stops being returned once it has them, but its slot keeps being computed (and padded
columns keep being carried) until the longest row is done; requests that arrive meanwhile wait for
the whole batch. Continuous batching, a later chapter, lets rows leave and join at every step.

What a later chapter may plug in: ``cache_factory(batch_size, max_seq_len) -> KVCache`` (chapter 4
passes a cache backed by its pre-allocated pool; the cache is used only during the call, so a caller
that lends pool memory takes it back after :func:`generate_batch` returns or raises).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from shared.devices import synchronize
from shared.model import GPT, DynamicKVCache, KVCache

# (batch_size, max_seq_len) -> an empty cache for that many rows; it will hold at most max_seq_len positions.
CacheFactory = Callable[[int, int], KVCache]


@dataclass
class RowOutput:
    """One request's share of a batch: its new ids and where the time went (milliseconds)."""

    output_ids: list[int]
    timings_ms: dict[str, float] = field(default_factory=dict)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, position_ids)``, each (B, longest prompt), padded on the left."""
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
    """Cut a batch, in order, into consecutive groups whose padded length fits ``n_ctx``.

    Each request fits on its own (the API checked that), but a long prompt and a long answer from two
    different requests may not fit side by side. With the benchmark's workload this never splits.
    """
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


@torch.no_grad()
def batched_greedy(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    pad_id: int,
    cache_factory: CacheFactory | None = None,
    prefill: Prefill = "by_length",
) -> list[RowOutput]:
    """Greedy continuations of every prompt, computed together: row ``i`` gets exactly ``max_new_tokens[i]`` ids.

    The prompt pass (``prefill``: :func:`prefill_by_length`, or :func:`prefill_padded`, the textbook
    version that computes the padding too) leaves one left-padded cache; then one decode step per new
    token runs for all rows at once, until the row that wants the most is done. The padded batch must
    fit the context (:func:`fits_in_context`; :func:`generate_batch` splits a batch that does not).
    """
    if len(prompts) != len(max_new_tokens) or not prompts:
        raise ValueError("need one max_new_tokens per prompt, and at least one prompt")
    if not fits_in_context(prompts, max_new_tokens, model.config.n_ctx):
        raise ValueError(f"the padded batch exceeds the context of {model.config.n_ctx}; split it first")
    device = model.device
    batch, steps = len(prompts), max(max_new_tokens)
    input_ids, attention_mask, position_ids = left_pad(prompts, pad_id, device)
    padded = bool((attention_mask == 0).any())
    # The last token generated is never fed back, so the cache holds the prompt plus steps - 1 positions.
    cache = (cache_factory or _dynamic_cache(model))(batch, input_ids.shape[1] + steps - 1)
    outputs: list[list[int]] = [[] for _ in prompts]
    finished_ms = [0.0] * batch

    started = time.perf_counter()
    if prefill == "padded":
        next_ids = prefill_padded(model, input_ids, attention_mask if padded else None, position_ids, cache)
    else:
        next_ids = prefill_by_length(model, prompts, cache)
    position_ids = position_ids[:, -1:]  # from now on: each row's newest position
    for step in range(steps):
        if step > 0:
            # Feed each row its newest token, one position after its last one; the mask grows a column.
            position_ids = position_ids + 1
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
            logits = model(
                next_ids[:, None],
                position_ids=position_ids,
                # Without padding the plain causal path is exact and faster: only pass a mask when needed.
                attention_mask=attention_mask if padded else None,
                cache=cache,
                last_token_only=True,
            )
            next_ids = logits[:, -1, :].argmax(dim=-1)
        tokens = next_ids.tolist()  # one device sync per step
        elapsed_ms = (time.perf_counter() - started) * 1e3
        if step == 0:
            prefill_ms = elapsed_ms
        for row, token in enumerate(tokens):
            if len(outputs[row]) < max_new_tokens[row]:  # a finished row is still computed, no longer returned
                outputs[row].append(token)
                if len(outputs[row]) == max_new_tokens[row]:
                    finished_ms[row] = elapsed_ms
    synchronize(device)
    batch_ms = (time.perf_counter() - started) * 1e3
    return [
        RowOutput(ids, {"prefill": prefill_ms, "decode": done - prefill_ms, "batch": batch_ms})
        for ids, done in zip(outputs, finished_ms)
    ]


def prefill_padded(
    model: GPT, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor, cache: KVCache
) -> Tensor:
    """The textbook prompt pass: the whole left-padded batch at once. Returns each row's first new token.

    Simple, but every row is computed at the longest prompt's length: the padding costs as much as
    real tokens (masked, not skipped).
    """
    logits = model(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, last_token_only=True)
    return logits[:, -1, :].argmax(dim=-1)


def prefill_by_length(model: GPT, prompts: Sequence[Sequence[int]], cache: KVCache) -> Tensor:
    """The prompt pass without computing any padding. Returns each row's first new token.

    Prompts of the same length go through together, with no padding and no mask (the plain causal
    path: exactly what each would compute alone). Their keys and values are then copied into one
    zero-filled, left-padded tensor per layer (the attention mask hides the zeros) and stored into
    ``cache`` as if one padded pass had written them: the cache sees an ordinary prefill through
    :class:`~shared.model.KVCache`'s ``update`` and ``advance``.
    """
    device, n_layer = model.device, model.config.n_layer
    longest = max(len(p) for p in prompts)
    first_ids = torch.empty(len(prompts), dtype=torch.long, device=device)
    keys: list[Tensor] = []  # per layer: (B, H, longest, D)
    values: list[Tensor] = []
    for length, rows in _rows_by_length(prompts).items():
        capture = _CapturingCache(n_layer)
        ids = torch.tensor([list(prompts[r]) for r in rows], dtype=torch.long, device=device)
        logits = model(ids, cache=capture, last_token_only=True)
        first_ids[rows] = logits[:, -1, :].argmax(dim=-1)
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
    return first_ids


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

    def advance(self, n_tokens: int) -> None:
        pass


def _dynamic_cache(model: GPT) -> CacheFactory:
    return lambda batch_size, max_seq_len: DynamicKVCache(model.config.n_layer)


def generate_batch(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    pad_id: int,
    cache_factory: CacheFactory | None = None,
    prefill: Prefill = "by_length",
) -> list[RowOutput]:
    """:func:`batched_greedy` for any batch of valid requests, split where the padded batch would not fit."""
    groups = split_to_fit([(len(p), n) for p, n in zip(prompts, max_new_tokens)], model.config.n_ctx)
    outputs: list[RowOutput] = []
    for group in groups:
        outputs += batched_greedy(
            model, [prompts[i] for i in group], [max_new_tokens[i] for i in group], pad_id, cache_factory, prefill
        )
    return outputs
