"""Chapter 8's chat route with the real model, through the official ``openai`` client over a real socket.

The oracle is transformers (``tests/llama_oracle.py``): Hugging Face's rendering of the model's chat
template for the prompt, its greedy tokens for the answer, which the turn must equal up to and
including the end-of-turn token (``<|im_end|>``), never shown in the content. Streamed, the pieces
add up to the same content, the role comes first and the end reason last. A battery of bad requests
gets OpenAI's error shape and statuses, never a 500, and the server answers a good request after it.
"""

from __future__ import annotations

import json

import openai
import torch
import pytest
import requests

from benchmarks.harness.server_process import running_module
from chapters.ch08_continuous_batching.chat_api import ChatApi
from shared.schemas import ApiError, ContractLimits
from shared.tokenizer import ByteTokenizer

MODULE = "chapters.ch08_continuous_batching"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATION = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}]
LONGEST_TURN = 48


@pytest.fixture(scope="module")
def ch08():
    args = ["--weights", "smollm2", "--device", "cpu", "--precision", "fp32", "--attention", "gather", "--max-num-seqs", "8",
            "--pool-tokens", "8192", "--probe-interval-s", "3600"]
    with running_module(MODULE, args, name="ch08", startup_timeout_s=300) as running:
        yield running


@pytest.fixture(scope="module")
def client(ch08) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ch08.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def oracle_turn(llama_oracle, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, the greedy turn up to and including the end-of-turn token) as transformers computes them."""
    ids = llama_oracle.tokenizer.encode(llama_oracle.chat_prompt(messages), add_special_tokens=False)
    answer = llama_oracle(ids, LONGEST_TURN)
    end = llama_oracle.tokenizer.eos_token_id
    return ids, answer[: answer.index(end) + 1] if end in answer else answer


@pytest.mark.parametrize("messages", [CAPITAL, CONVERSATION], ids=["one question", "a conversation"])
def test_a_chat_turn_is_the_oracles_up_to_its_end_of_turn(client, model_name, llama_oracle, messages) -> None:
    ids, turn = oracle_turn(llama_oracle, messages)
    assert turn[-1] == llama_oracle.tokenizer.eos_token_id, "the oracle's turn must end within LONGEST_TURN tokens"
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=LONGEST_TURN)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert choice.message.content == llama_oracle.tokenizer.decode(turn[:-1])
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(turn))
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")


def test_the_first_answer_is_the_sensible_one(client, model_name) -> None:
    reply = client.chat.completions.create(model=model_name, messages=CAPITAL)
    assert reply.choices[0].message.content.startswith("The capital of France is Paris.")


def test_a_streamed_turn_sends_the_role_first_then_the_same_content_then_the_reason(client, model_name, llama_oracle) -> None:
    ids, turn = oracle_turn(llama_oracle, CAPITAL)
    chunks = list(client.chat.completions.create(model=model_name, messages=CAPITAL, max_completion_tokens=LONGEST_TURN,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == llama_oracle.tokenizer.decode(turn[:-1])
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"] and chunks[-1].usage.completion_tokens == len(turn)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_a_turn_cut_by_max_tokens_ends_for_length_with_the_oracles_first_tokens(client, model_name, llama_oracle) -> None:
    ids, turn = oracle_turn(llama_oracle, CAPITAL)
    reply = client.chat.completions.create(model=model_name, messages=CAPITAL, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content == llama_oracle.tokenizer.decode(turn[:3])


def test_a_stop_string_ends_the_turn_and_logprobs_cover_what_is_shown(client, model_name, llama_oracle) -> None:
    ids, turn = oracle_turn(llama_oracle, CAPITAL)
    whole = llama_oracle.tokenizer.decode(turn[:-1])
    reply = client.chat.completions.create(model=model_name, messages=CAPITAL, stop=[" Paris"], logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == whole[: whole.index(" Paris")]
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries).startswith(choice.message.content)
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert len("".join(e.token for e in entries[:-1])) < len(choice.message.content)  # the last starts before the cut


def test_the_same_seed_samples_the_same_turn_twice(client, model_name) -> None:
    def sample() -> str:
        reply = client.chat.completions.create(model=model_name, messages=CONVERSATION, temperature=1.0, top_p=0.9, seed=7,
                                               max_tokens=24)
        return reply.choices[0].message.content

    assert sample() == sample()


BAD = [
    ({"model": "gpt-4", "messages": CAPITAL}, 404),
    ({"messages": []}, 422),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 422),
    ({"messages": [{"role": "user"}]}, 422),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 422),
    ({"messages": CAPITAL, "max_tokens": 0}, 422),
    ({"messages": CAPITAL, "n": 2}, 422),
    ({"messages": CAPITAL, "tools": []}, 422),
    ({"messages": CAPITAL, "top_logprobs": 2}, 422),
    ({"messages": CAPITAL, "temperature": 9}, 422),
]


@pytest.mark.parametrize("body, status", BAD, ids=[f"{i}-{s}" for i, (_, s) in enumerate(BAD)])
def test_bad_chat_requests_get_openais_error_shape_and_never_a_500(ch08, model_name, body, status) -> None:
    response = requests.post(f"{ch08.url}/v1/chat/completions", json={"model": model_name, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]


def test_the_server_answers_after_the_bad_requests(client, model_name, ch08) -> None:
    requests.post(f"{ch08.url}/v1/chat/completions", data=b"{not json", timeout=60)
    reply = client.chat.completions.create(model=model_name, messages=CAPITAL, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"


def test_a_model_without_a_chat_template_answers_the_route_with_a_400() -> None:
    api = ChatApi(backend=None, tokenizer=ByteTokenizer(), limits=ContractLimits(256, 512, 64, 65536), model_name="tiny")
    with pytest.raises(ApiError) as refused:
        api.parse(json.dumps({"model": "tiny", "messages": CAPITAL}).encode())
    assert refused.value.status == 400 and "no chat template" in str(refused.value)


# -- stop strings and log-probabilities, exact against transformers (both OpenAI routes) ---------------------


def token_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text starts in the decoded answer (characters)."""
    return [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]


def cut_by(stop: str, tokenizer, turn: list[int]) -> tuple[str, int, int]:
    """(the text shown, the tokens with log-probabilities, the tokens generated) when ``stop`` ends ``turn``:
    the text up to the stop, the tokens whose text starts before it, and every token up to the one that completes it."""
    whole = tokenizer.decode(turn)
    cut = whole.index(stop)
    generated = next(k + 1 for k in range(len(turn)) if stop in tokenizer.decode(turn[: k + 1]))
    shown = sum(1 for offset in token_offsets(tokenizer, turn) if offset < cut)
    return whole[:cut], shown, generated


@pytest.fixture(scope="module")
def capital(llama_oracle) -> tuple[list[int], list[int]]:
    return oracle_turn(llama_oracle, CAPITAL)


STOPS = {"inside one token": "ari", "across two tokens": "France is"}


@pytest.mark.parametrize("where", STOPS)
def test_a_stop_string_leaves_the_text_the_logprobs_and_the_stream_alike(client, model_name, llama_oracle, capital, where) -> None:
    stop, tokenizer = STOPS[where], llama_oracle.tokenizer
    ids, turn = capital
    offsets = token_offsets(tokenizer, turn)
    start = tokenizer.decode(turn).index(stop)
    inside = [i for i in range(len(turn)) if offsets[i] <= start and start + len(stop) <= offsets[i] + len(tokenizer.decode(turn[i:i + 1]))]
    assert bool(inside) == (where == "inside one token"), "the stop must lie where the case says"
    text, shown, generated = cut_by(stop, tokenizer, turn)
    reply = client.completions.create(model=model_name, prompt=ids, max_tokens=LONGEST_TURN, stop=[stop], logprobs=2)
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason, reply.usage.completion_tokens) == (text, "stop", generated)
    assert choice.logprobs.text_offset == offsets[:shown]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in turn[:shown]]
    streamed = list(client.completions.create(model=model_name, prompt=ids, max_tokens=LONGEST_TURN, stop=[stop], logprobs=2, stream=True))
    entries = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert [offset for e in entries for offset in e.text_offset] == offsets[:shown]
    chat = client.chat.completions.create(model=model_name, messages=CAPITAL, stop=[stop], logprobs=True, top_logprobs=1, stream=True)
    chunks = list(chat)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] == \
        [tokenizer.decode([t]) for t in turn[:shown]]


def test_sampled_logprobs_are_the_models_own_for_the_chosen_token_and_its_alternatives(client, model_name, llama_oracle, capital) -> None:
    """Sampled at temperature 1, the chosen tokens are often not the most likely: each entry must hold the
    model's log-softmax of the token it chose, and the alternatives' must be the model's most likely."""
    ids, _ = capital
    tokenizer = llama_oracle.tokenizer
    reply = client.completions.create(model=model_name, prompt=ids, max_tokens=24, temperature=1.0, seed=11, logprobs=3)
    by_text = {}
    for token_id in range(tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else len(tokenizer)):
        by_text.setdefault(tokenizer.decode([token_id]), []).append(token_id)
    logprobs = reply.choices[0].logprobs
    chosen = [by_text[text][0] if len(by_text.get(text, [])) == 1 else None for text in logprobs.tokens]
    assert all(c is not None for c in chosen), "every sampled token's text names one token"
    assert reply.usage.completion_tokens == len(chosen)
    model = torch.log_softmax(llama_oracle.logits(ids + chosen[:-1])[len(ids) - 1:].float(), dim=-1)
    assert any(model[i].argmax() != c for i, c in enumerate(chosen)), "sampling chose only the most likely tokens: no test"
    for i, (token, value, top) in enumerate(zip(chosen, logprobs.token_logprobs, logprobs.top_logprobs)):
        assert value == pytest.approx(float(model[i, token]), abs=2e-3), i
        best = torch.topk(model[i], 3)
        assert {tokenizer.decode([t]): float(v) for t, v in zip(best.indices.tolist(), best.values)} == pytest.approx(top, abs=2e-3), i
