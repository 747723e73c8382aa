"""The shared model: the KV cache, left padding, weight files, parity with Hugging Face, the trained default."""

from __future__ import annotations

import pytest
import torch

from shared.corpus import evaluate
from shared.generation import greedy_generate, reference_greedy
from shared.model import GPT, DynamicKVCache, ModelConfig, init_weights
from shared.tokenizer import PAD_ID, ByteTokenizer
from shared.weights import LoadedModel, load_model, save_safetensors

TOKENIZER = ByteTokenizer()
PROMPTS = ["37+45=", "the old robot paints a blue kite", "q", "12+30=24\n88+19=7"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generation_with_the_cache_equals_the_oracle(default_model: LoadedModel, prompt: str) -> None:
    ids = TOKENIZER.encode(prompt)
    expected = reference_greedy(default_model.model, ids, 24)
    assert greedy_generate(default_model.model, ids, 24, DynamicKVCache(default_model.config.n_layer)) == expected
    assert len(expected) == 24


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention_mask and position_ids of a left-padded batch; positions count real tokens only."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids, mask, positions


@torch.no_grad()
def test_left_padded_batch_equals_each_prompt_alone(default_model: LoadedModel) -> None:
    model = default_model.model
    prompts = [TOKENIZER.encode(p) for p in PROMPTS]
    ids, mask, positions = _left_padded(prompts)
    cache = DynamicKVCache(model.config.n_layer)
    batch_logits = model(ids, position_ids=positions, attention_mask=mask, cache=cache, last_token_only=True)[:, -1]

    alone_caches = [DynamicKVCache(model.config.n_layer) for _ in prompts]
    alone_logits = torch.stack([
        model(torch.tensor([p]), cache=c, last_token_only=True)[0, -1] for p, c in zip(prompts, alone_caches)
    ])
    torch.testing.assert_close(batch_logits, alone_logits, atol=1e-4, rtol=1e-4)
    next_ids = batch_logits.argmax(dim=-1)
    assert next_ids.tolist() == alone_logits.argmax(dim=-1).tolist()

    # One cached decode step: each row's new token sits one past its own last real position.
    for _ in range(2):
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        batch_logits = model(next_ids[:, None], position_ids=positions, attention_mask=mask, cache=cache)[:, -1]
        alone_logits = torch.stack([model(t.view(1, 1), cache=c)[0, -1] for t, c in zip(next_ids, alone_caches)])
        torch.testing.assert_close(batch_logits, alone_logits, atol=1e-4, rtol=1e-4)
        assert batch_logits.argmax(dim=-1).tolist() == alone_logits.argmax(dim=-1).tolist()
        next_ids = batch_logits.argmax(dim=-1)


SMALL = ModelConfig(vocab_size=300, n_ctx=64, n_embd=32, n_layer=2, n_head=4)


@torch.no_grad()
def test_safetensors_round_trip(tmp_path) -> None:
    original = init_weights(GPT(SMALL), seed=3).eval()
    path = tmp_path / "small.safetensors"
    save_safetensors(original, path)
    loaded = load_model(str(path)).model
    assert loaded.config == SMALL  # the shape travels in the file's metadata
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, SMALL.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(original(ids), loaded(ids))


@torch.no_grad()
def test_logits_match_transformers_gpt2(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(
        vocab_size=SMALL.vocab_size, n_positions=SMALL.n_ctx, n_embd=SMALL.n_embd, n_layer=SMALL.n_layer, n_head=SMALL.n_head
    )
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(hf_config).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)

    ours = load_model(str(tmp_path)).model
    assert ours.config == SMALL
    ids = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids), reference(ids).logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_exceeding_the_context_raises(default_model: LoadedModel) -> None:
    model = default_model.model
    n_ctx = model.config.n_ctx
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, n_ctx + 1, dtype=torch.long))
    cache = DynamicKVCache(model.config.n_layer)
    model(torch.zeros(1, n_ctx, dtype=torch.long), cache=cache, last_token_only=True)  # exactly full: fine
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_default_model_solves_held_out_additions(default_model: LoadedModel) -> None:
    score = evaluate(default_model.model)
    assert score.accuracy >= 0.90, f"{score.correct}/{score.total} held-out additions right"
