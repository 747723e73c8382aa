"""Chapter 3's batched generation returns, row by row, exactly what the oracle returns for each request alone.

The oracle (``reference_greedy``: no cache, no batch, no padding) is the truth; the batched code is
never compared with itself.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from chapters.ch03_dynamic_batching.batched_generation import (
    batched_greedy,
    fits_in_context,
    generate_batch,
    left_pad,
    split_to_fit,
)
from shared.corpus import corpus_lines
from shared.model import DynamicKVCache
from shared.tokenizer import ByteTokenizer


def corpus_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Slices of the kind of text the default model was trained on, so its answers are not noise."""
    text = "".join(itertools.islice(corpus_lines(seed=seed), 300))
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        start = rng.randrange(len(text) - length)
        prompts.append(ByteTokenizer().encode(text[start : start + length]))
    return prompts


def test_left_padding_masks_padding_and_counts_real_positions() -> None:
    input_ids, mask, positions = left_pad([[5, 6, 7], [9]], pad_id=257, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7], [257, 257, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("prefill", ["by_length", "padded"])
def test_mixed_prompt_lengths_and_new_token_counts_match_the_oracle(default_model, oracle, prefill) -> None:
    lengths = [16, 128, 3, 64, 32, 1, 90, 16]
    new_tokens = [32, 1, 20, 7, 32, 5, 2, 13]
    prompts = corpus_prompts(lengths, seed=11)
    rows = batched_greedy(default_model.model, prompts, new_tokens, default_model.tokenizer.pad_id, prefill=prefill)
    for prompt, n, row in zip(prompts, new_tokens, rows):
        assert len(row.output_ids) == n
        assert row.output_ids == oracle(prompt, n), f"prompt of {len(prompt)} tokens, {n} new"


@pytest.mark.parametrize("prefill", ["by_length", "padded"])
def test_a_batch_without_padding_matches_the_oracle(default_model, oracle, prefill) -> None:
    prompts = corpus_prompts([24, 24, 24], seed=12)
    rows = batched_greedy(default_model.model, prompts, [9, 4, 9], default_model.tokenizer.pad_id, prefill=prefill)
    assert [row.output_ids for row in rows] == [oracle(p, n) for p, n in zip(prompts, [9, 4, 9])]


@pytest.mark.parametrize("prefill", ["by_length", "padded"])
def test_the_cache_comes_from_the_injected_factory(default_model, oracle, prefill) -> None:
    """Chapter 4's hook: the cache is asked for once, sized for the padded batch."""
    requested = []

    def recording_factory(batch_size: int, max_seq_len: int) -> DynamicKVCache:
        requested.append((batch_size, max_seq_len))
        return DynamicKVCache(default_model.config.n_layer)

    prompts = corpus_prompts([10, 20], seed=13)
    rows = batched_greedy(default_model.model, prompts, [3, 6], default_model.tokenizer.pad_id, recording_factory, prefill)
    assert requested == [(2, 20 + 6 - 1)]  # the padded prompt, plus every new token but the last
    assert [row.output_ids for row in rows] == [oracle(prompts[0], 3), oracle(prompts[1], 6)]


def test_a_batch_too_long_once_padded_is_split_and_still_matches_the_oracle(default_model, oracle) -> None:
    n_ctx = default_model.config.n_ctx
    prompts = corpus_prompts([n_ctx - 50, 5, 7], seed=14)
    new_tokens = [3, 60, 2]  # each fits alone; the long prompt and the long answer do not fit side by side
    assert not fits_in_context(prompts, new_tokens, n_ctx)
    rows = generate_batch(default_model.model, prompts, new_tokens, default_model.tokenizer.pad_id)
    assert [row.output_ids for row in rows] == [oracle(p, n) for p, n in zip(prompts, new_tokens)]


def test_split_to_fit_keeps_order_and_cuts_only_where_needed() -> None:
    assert split_to_fit([(10, 5), (20, 5), (30, 5)], n_ctx=100) == [range(3)]
    assert split_to_fit([(90, 5), (5, 50), (5, 40), (80, 1)], n_ctx=100) == [range(1), range(1, 3), range(3, 4)]
