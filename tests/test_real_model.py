"""Every chapter serves the real model (``--weights smollm2``): a chat-templated question gets transformers' tokens.

The oracle is transformers' ``LlamaForCausalLM`` on the same GGUF file (``tests/llama_oracle.py``),
computed in this process before each server starts. A short answer per request keeps this in the fast
suite; ``test_concurrent_mixed_chat_requests_get_transformers_tokens`` sends prompts of several lengths
at once, so request-level batches pad them and chapter 8 runs them in one packed step. Chapter 9 (a
Ray cluster, Serve's proxy and one replica of chapter 8's server, each replica loading the model
itself) answers the same questions through the proxy, in the slow suite: Ray's start and the
replica's load take most of a minute. For the fast suite's time only chapter 5 (chapter 3's request-level batches
and chapter 4's pool, run by its engine) and chapter 8 (packed steps on a paged cache) answer here; chapters 1 to 4,
6 and 7 answer in the slow suite. Chapter 8 is started with ``--attention kernel``: at ``auto`` a
fresh start (as every run of the suite is) first times each attention backend over whole steps of the real model, most
of the start; the rule is tested on the default model, and each backend's tokens on this one in ``test_ch08_llama``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from chapter_flags import oracle_exact_args

from benchmarks.harness.server_process import RunningServer, running_module
from chapters import CHAPTERS
from shared.chat_template import chat_prompt

QUESTIONS = ["What is the capital of France?", "Name a colour.", "Write a haiku about the sea, please, in English.",
             "Explain in one sentence why the sky looks blue during the day and red at sunset."]
NEW_TOKENS = (8, 5, 3, 6)
# Chapter 5 serves chapter 3's padded request-level batches from chapter 4's pool with its own engine, so on the real
# model it stands for chapters 1 to 4 in the fast suite; chapter 8 brings the other way to run it (packed steps on a
# paged cache). Chapters 2, 6 and 7 run the model as the chapter before them does.
SLOW_HERE = ("ch01", "ch02", "ch03", "ch04", "ch06", "ch07")
SERVED = [pytest.param(chapter, marks=pytest.mark.slow) if chapter in SLOW_HERE else chapter
          for chapter in CHAPTERS if chapter != "ch09"]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def chat_cases(smollm2, llama_oracle) -> list[tuple[dict, list[int], list[int]]]:
    """(request body, prompt ids, transformers' answer): half sent as chat-templated text, half as ids."""
    cases = []
    for i, (question, n) in enumerate(zip(QUESTIONS, NEW_TOKENS)):
        prompt = chat_prompt(smollm2.tokenizer, [{"role": "user", "content": question}])
        ids = smollm2.tokenizer.encode(prompt)
        body = {"prompt": prompt} if i % 2 == 0 else {"input_ids": ids}
        cases.append(({**body, "max_new_tokens": n}, ids, llama_oracle(ids, n)))
    return cases


@pytest.fixture(scope="module", params=SERVED)
def real_model_server(request, server, chat_cases) -> Iterator[RunningServer]:
    attention = ("--attention", "kernel") if request.param == "ch08" else ()  # module docstring
    with server(request.param, "--weights", "smollm2", *oracle_exact_args(request.param), *attention) as running:
        yield running


def test_prompts_have_several_lengths(chat_cases) -> None:
    assert len({len(ids) for _, ids, _ in chat_cases}) == len(chat_cases)


def test_concurrent_mixed_chat_requests_get_transformers_tokens(real_model_server: RunningServer, chat_cases) -> None:
    answers_all_at_once(real_model_server.url, real_model_server.chapter, chat_cases)


@pytest.mark.slow
def test_chapter_9_answers_through_serve_with_transformers_tokens(chat_cases) -> None:
    args = ["--weights", "smollm2", "--num-replicas", "1", "--spare-replicas", "0", "--replica-cpus", "0.5",
            "--precision", "fp32", "--attention", "gather", "--torch-threads", "1", "--max-num-seqs", "8",
            "--probe-interval-s", "3600", "--drain-timeout-s", "10"]
    with running_module("chapters.ch09_scale_out", args, name="ch09", startup_timeout_s=TIMEOUT_S) as running:
        answers_all_at_once(running.url, "ch09", chat_cases)


def answers_all_at_once(url: str, chapter: str, chat_cases) -> None:
    """Send every case at once; each answer must be transformers' tokens for its prompt."""
    def send(body: dict) -> requests.Response:
        return requests.post(f"{url}/v1/inference", json=body, timeout=TIMEOUT_S)

    with ThreadPoolExecutor(len(chat_cases)) as clients:
        responses = list(clients.map(send, [body for body, _, _ in chat_cases]))
    for response, (body, ids, expected) in zip(responses, chat_cases):
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert answer["output_ids"] == expected, (chapter, body.get("prompt", "ids")[:60])
    assert responses[0].json()["text"].startswith("The capital of France is Paris.")
