"""Chapter 8 over a real socket: token streams, the official ``openai`` client, and cancellation.

One server process (``python -m chapters.ch08_continuous_batching``) serves the module. Its
``/v1/inference`` streams one event per token; the ``openai`` client (the real one, not a mock)
talks to ``/v1/completions`` streaming and not, and its errors carry the contract's statuses.
100 open streams with half of them closed early must leave every block in the pool.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import requests
from sampling_oracle import reference_sampled

from benchmarks.harness.server_process import running_module

MODULE = "chapters.ch08_continuous_batching"


@pytest.fixture(scope="module")
def ch08():
    args = ["--device", "cpu", "--precision", "fp32", "--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--pool-tokens", "16384",
            "--probe-interval-s", "3600"]  # the readiness probe is a real request: one at start-up, none during the tests
    with running_module(MODULE, args, name="ch08") as running:
        yield running


@pytest.fixture(scope="module")
def client(ch08) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{ch08.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def stats(ch08) -> dict:
    return requests.get(f"{ch08.url}/stats", timeout=10).json()


def read_events(response: requests.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_inference_streams_one_event_per_token_then_the_whole_answer(ch08, oracle) -> None:
    prompt, n = list(b"12+34="), 12
    with requests.post(f"{ch08.url}/v1/inference", json={"input_ids": prompt, "max_new_tokens": n, "stream": True}, stream=True, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response)
    tokens = [data["token_id"] for name, data in events if name == "token"]
    assert tokens == oracle(prompt, n)
    name, done = events[-1]
    assert name == "done" and done["output_ids"] == tokens
    assert "".join(data["text"] for name, data in events if name == "token") == done["text"]
    assert done["timings_ms"]["ttft"] <= done["timings_ms"]["total"]


def test_the_openai_client_gets_the_oracles_completion_without_streaming(client, model_name, oracle, default_model) -> None:
    prompt = "7+8="
    completion = client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0)
    expected = default_model.tokenizer.decode(oracle(list(prompt.encode()), 10))
    assert completion.choices[0].text == expected and completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == 4 and completion.usage.completion_tokens == 10
    by_ids = client.completions.create(model=model_name, prompt=list(prompt.encode()), max_tokens=10)
    assert by_ids.choices[0].text == expected


def test_the_openai_client_streams_the_same_text_token_by_token(client, model_name, oracle, default_model) -> None:
    prompt = "21+13="
    chunks = list(client.completions.create(
        model=model_name, prompt=prompt, max_tokens=16, stream=True, stream_options={"include_usage": True},
    ))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 16  # one chunk per token, plus the closing one
    assert "".join(texts) == default_model.tokenizer.decode(oracle(list(prompt.encode()), 16))
    assert chunks[-1].usage.completion_tokens == 16


def test_the_openai_clients_errors_carry_the_contracts_statuses(client, model_name) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as over_context:
        client.completions.create(model=model_name, prompt="x" * 500, max_tokens=100)
    assert over_context.value.status_code == 422 and "context" in over_context.value.message
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=4, temperature=2.5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)


SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 11}


def test_the_openai_client_samples_with_a_seed_and_stops_at_a_stop_string(client, model_name, default_model) -> None:
    """Seeded sampling gives the sampling oracle's tokens; the text ends before the first stop string."""
    prompt, tokenizer = "Once upon a time, ", default_model.tokenizer
    sampled = tokenizer.decode(reference_sampled(default_model.model, list(prompt.encode()), 40, **SAMPLED))
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, **SAMPLED)
    assert plain.choices[0].text == sampled and plain.choices[0].finish_reason == "length"
    stop = sampled[12:14]  # two characters, two byte tokens: the stop spans a token boundary
    cut = sampled.find(stop)
    stopped = client.completions.create(model=model_name, prompt=prompt, max_tokens=40, stop=[stop, "\x00"], logprobs=2, **SAMPLED)
    choice = stopped.choices[0]
    assert choice.text == sampled[:cut] and choice.finish_reason == "stop"
    assert stopped.usage.completion_tokens == len(sampled[:cut + len(stop)].encode())  # the stop's tokens were generated ...
    assert "".join(choice.logprobs.tokens) == sampled[:cut]  # ... but, like its text, are not shown
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs) == cut
    assert all(len(top) <= 2 and lp <= 0 for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    assert choice.logprobs.text_offset == list(range(cut))  # one byte, one character here


def test_the_openai_client_streams_sampled_text_with_logprobs_and_the_same_stop(client, model_name, default_model) -> None:
    prompt, tokenizer = "Once upon a time, ", default_model.tokenizer
    sampled = tokenizer.decode(reference_sampled(default_model.model, list(prompt.encode()), 40, **SAMPLED))
    stop = sampled[20:23]
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=40, stop=stop, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}, **SAMPLED))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == sampled[:sampled.find(stop)]
    assert choices[-1].finish_reason == "stop" and all(c.finish_reason is None for c in choices[:-1])
    per_token = [c.logprobs for c in choices if c.logprobs is not None]
    shown = sampled[:sampled.find(stop)]
    assert chunks[-1].usage.completion_tokens == len(shown) + len(stop)  # the stop's tokens were generated ...
    assert sum(len(lp.tokens) for lp in per_token) == len(shown)  # ... log-probabilities for each token shown
    assert "".join(token for lp in per_token for token in lp.tokens) == shown


def test_the_openai_client_gets_a_422_naming_each_field_this_server_does_not_implement(client, model_name) -> None:
    for field, value in (("n", 2), ("echo", True), ("presence_penalty", 0.5), ("best_of", 3), ("logprobs", 6)):
        with pytest.raises(openai.UnprocessableEntityError, match=field):
            client.completions.create(model=model_name, prompt="hi", max_tokens=4, **{field: value})
    with pytest.raises(openai.UnprocessableEntityError, match="min_p"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=4, extra_body={"min_p": 0.1})
    with pytest.raises(openai.UnprocessableEntityError, match="stop"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=4, stop=["a", "b", "c", "d", "e"])


def test_100_open_streams_with_half_closed_early_leave_every_block_in_the_pool(ch08, oracle) -> None:
    async def one(client: httpx.AsyncClient, index: int) -> list[int] | None:
        cancel = index % 2 == 1
        body = {"input_ids": [1 + index % 200, 2, 3], "max_new_tokens": 250 if cancel else 8, "stream": True}
        tokens: list[int] = []
        async with client.stream("POST", "/v1/inference", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"token_id"' in line:
                    tokens.append(json.loads(line[6:])["token_id"])
                    if cancel:
                        return None  # leaving the block closes the connection mid-stream
        return tokens

    async def main() -> list[list[int] | None]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=ch08.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    before = stats(ch08)["scheduler"]
    results = asyncio.run(main())
    for index, tokens in enumerate(results):
        if index % 2 == 0:
            assert tokens == oracle([1 + index % 200, 2, 3], 8)
    # The server learns of a closed connection on its own schedule: poll its figures, bounded in time.
    deadline = time.monotonic() + 30
    while (now := stats(ch08))["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    scheduler = now["scheduler"]
    assert now["in_flight"] == 0 and scheduler["running"] == scheduler["waiting"] == 0
    assert scheduler["blocks_used"] == 0 and scheduler["blocks_free"] == scheduler["blocks_total"]
    assert scheduler["aborted"] - before["aborted"] == 50
    assert scheduler["finished"] - before["finished"] == 50
