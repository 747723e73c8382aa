"""The vLLM peer study's parts that run without vLLM: the export, the client's OpenAI mode, the README block.

vLLM itself is not installed by the project (it lives in a venv of its own); that vLLM serves the
exported directory with the oracle's tokens is the study's manual ``peer check``.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from benchmarks.harness import streaming
from benchmarks.harness.server_process import free_port
from benchmarks.report.peer_blocks import VLLM_PEER_DIR, vllm_peer_block
from benchmarks.studies.vllm_peer.export_hf import export
from benchmarks.studies.vllm_peer.peer import VLLM_REQUEST_EXTRA, measured_routes, results_path, vllm_command, vllm_env
from chapters.ch08_continuous_batching.openai_api import CompletionsApi
from shared.schemas import ApiError, ContractLimits
from shared.tokenizer import ByteTokenizer
from shared.weights import load_hf_gpt2

PROMPTS = ["37+45=", "the old robot paints", "12+99=", "a"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("vllm-peer") / "tiny-default-hf")


# --- the export -----------------------------------------------------------------------------------


def test_the_export_holds_exactly_the_embedded_weights(exported: Path, default_model) -> None:
    back = load_hf_gpt2(exported).state_dict()  # the project's own reader of GPT-2 directories, names mapped back
    ours = default_model.model.state_dict()
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[name], ours[name]) for name in ours)


def test_transformers_gpt2_gives_the_oracles_greedy_tokens(exported: Path, oracle) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(exported, dtype=torch.float32).eval()
    for text in PROMPTS:
        prompt = list(text.encode())
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(16):  # greedy, the whole sequence each step, as the oracle computes it
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert ids[0, len(prompt):].tolist() == oracle(prompt, 16), text


def test_the_tokenizer_loads_and_round_trips_byte_ids(exported: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    text = "12+34=64\nthe old robot é ü ✓"
    ids = tokenizer.encode(text)
    assert ids == ByteTokenizer().encode(text)  # one token per UTF-8 byte, the byte's value as its id
    assert tokenizer.decode(ids) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (ByteTokenizer.eos_id, ByteTokenizer.pad_id, 258)
    assert tokenizer.decode([ByteTokenizer.eos_id]) == "<|endoftext|>"


# --- the client's OpenAI mode ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_chapter_8s_openai_route_accepts_what_the_client_sends(stream: bool) -> None:
    api = CompletionsApi(backend=None, tokenizer=ByteTokenizer(), model_name="tiny-default",
                         limits=ContractLimits(vocab_size=258, n_ctx=512, max_new_tokens=256, max_body_bytes=1 << 20))
    body = streaming.default_body(random.Random(3))
    request, valid = api.parse(json.dumps(streaming.openai_body(body, "tiny-default", stream)).encode())
    assert (valid.input_ids, valid.max_new_tokens, request.stream) == (body["input_ids"], body["max_new_tokens"], stream)
    assert valid.sampling.temperature == 0.0  # greedy: the oracle's tokens
    # vLLM's own field is refused by chapter 8, which is why the client adds it for vLLM alone
    with pytest.raises(ApiError, match="ignore_eos"):
        api.parse(json.dumps(streaming.openai_body(body, "tiny-default", stream, VLLM_REQUEST_EXTRA)).encode())


class FakeOpenAIServer:
    """``/v1/models`` and ``/v1/completions`` the way vLLM (``style="vllm"``: the last token's chunk carries
    ``finish_reason``) or chapter 8 (``"ch08"``: a chunk of its own after the last token) answers, each token a
    chunk; ``short`` tokens fewer than asked, as a server that stopped at end-of-text. Keeps every body it got."""

    def __init__(self, style: str, short: int = 0) -> None:
        self.style, self.short, self.bodies = style, short, []

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "served-name", "object": "model"}]})

    async def completions(self, request):
        from aiohttp import web

        body = await request.json()
        self.bodies.append(body)
        n = body["max_tokens"] - self.short
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x" * n, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            last = i == n - 1 and self.style == "vllm"
            await response.write(b"data: " + json.dumps({"choices": [{"text": "x", "finish_reason": "length" if last else None}]}).encode() + b"\n\n")
        if self.style == "ch08":
            await response.write(b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n')
        await response.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def measure(self, stream: bool, extra: dict | None = None) -> list[streaming.RequestRecord]:
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            records, _ = await streaming.run_closed_loop(f"http://127.0.0.1:{port}", 3, 0.3, "mixed", stream, api="openai",
                                                         openai_extra=extra)
        finally:
            await runner.cleanup()
        return records


@pytest.mark.parametrize("style", ["vllm", "ch08"])
def test_the_openai_client_counts_every_streamed_token_once(style: str) -> None:
    server = FakeOpenAIServer(style)
    records = asyncio.run(server.measure(stream=True, extra={"ignore_eos": True}))
    assert records and all(r.ok for r in records)
    for record in records:
        assert record.output_tokens == record.requested_tokens
        assert len(record.token_times) == record.output_tokens  # chapter 8's closing chunk carries no token
    body = server.bodies[0]
    assert body["model"] == "served-name" and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True} and all(isinstance(t, int) for t in body["prompt"])
    summary = streaming.summarize(records, 0.3, None, None, None)
    assert summary["short_answers"] == 0 and summary["tpot_ms"] is not None


def test_the_openai_client_reads_whole_answers_and_counts_short_ones() -> None:
    server = FakeOpenAIServer("vllm", short=1)
    records = asyncio.run(server.measure(stream=False))
    assert records and all(r.ok and not r.token_times for r in records)
    assert all(r.output_tokens == r.requested_tokens - 1 for r in records)
    assert "stream" not in server.bodies[0] and "ignore_eos" not in server.bodies[0]
    assert streaming.summarize(records, 0.3, None, None, None)["short_answers"] == len(records)


def test_the_contract_route_reports_no_short_answers_field() -> None:
    record = streaming.RequestRecord(sent=0.0, status=200, ended=1.0, output_tokens=4)
    assert "short_answers" not in streaming.summarize([record], 1.0, None, None, None)


# --- the run and its README block ------------------------------------------------------------------


def test_vllm_starts_through_its_module_pinned_to_the_servers_cores(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 512}))
    command = vllm_command(Path("/venv/bin/python"), tmp_path, 8123, "bfloat16", ["--max-num-seqs", "64"])
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--max-model-len") + 1] == "512" and command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[-2:] == ["--max-num-seqs", "64"]
    assert vllm_env([0], 1) == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(None, 1)
    assert results_path(tmp_path, "shared-prefix", "stream") == tmp_path / "shared-prefix-stream.json"


def _peer_file(ch08_qps: list[float], vllm_qps: list[float], answers: str, inference_qps: list[float] | None = None) -> dict:
    def server(qps: list[float], p99_ms: float = 1000.0) -> dict:
        rounds = [{"qps": q, "errors": {}, "short_answers": 0, "e2e_ms": {"p99": p99_ms}, "ttft_ms": {"p50": 50.0, "p99": 90.0}}
                  for q in qps]
        return {**streaming.median_round(rounds)}

    servers = {"ch08": server(ch08_qps), "vllm": server(vllm_qps)}
    if inference_qps:
        servers["ch08-inference"] = server(inference_qps, 1500.0)
    document = streaming.compare_document("mixed", 64, 25.0, servers, "python -m x", rounds=len(ch08_qps))
    document.update(kind="vllm-peer", answers=answers, servers={"vllm": {"version": "0.32.0", "dtype": "bfloat16"}})
    return document


def test_the_block_says_not_measured_until_a_file_exists_then_reads_it(tmp_path: Path) -> None:
    assert vllm_peer_block(tmp_path).startswith("*Not measured yet: `python -m benchmarks.studies.vllm_peer.peer compare")
    folder = tmp_path / VLLM_PEER_DIR
    folder.mkdir()
    (folder / "mixed-whole.json").write_text(json.dumps(_peer_file([40.0, 44.0, 42.0], [30.0, 35.0, 20.0], "whole")))
    text = vllm_peer_block(tmp_path)
    # medians 42 and 30 (the median-QPS rounds); each round paired in order: 40/30, 44/35, 42/20
    assert "| `mixed` | whole | 64 | 3 | 42.0 | 30.0 | 1.40× (1.33, 1.26, 2.10) | 1.00 / 1.00 | — | — | 0, 0 |" in text
    assert "vLLM 0.32.0 at bfloat16" in text and "/v1/inference" not in text


def test_chapter_8s_own_route_is_measured_for_whole_answers_and_gets_its_row(tmp_path: Path) -> None:
    assert measured_routes("ch08", "shared-prefix", "whole") == [("ch08", "openai"), ("ch08-inference", "inference")]
    assert measured_routes("ch08", "shared-prefix", "stream") == [("ch08", "openai")]
    assert measured_routes("vllm", "shared-prefix", "whole") == [("vllm", "openai")]
    folder = tmp_path / VLLM_PEER_DIR
    folder.mkdir()
    (folder / "mixed-whole.json").write_text(json.dumps(_peer_file([40.0], [20.0], "whole", inference_qps=[30.0])))
    text = vllm_peer_block(tmp_path)
    assert "| `mixed` | whole | 64 | 1 | 40.0 | 20.0 | 2.00× (2.00) | 1.00 / 1.00 |" in text
    assert "| `mixed` | whole, ch08 on `/v1/inference` | 64 | 1 | 30.0 | 20.0 | 1.50× (1.50) | 1.50 / 1.00 |" in text
    assert "the `/v1/inference` rows: chapter 8's own route" in text


def test_the_block_is_registered_for_the_readmes() -> None:
    from benchmarks.report.readme_blocks import render_key

    assert render_key("vllm-peer", {}, Path("/nonexistent"), Path("README.md"), "cpu").startswith("*Not measured yet")


def test_another_kind_of_core_reads_its_own_folder(tmp_path: Path) -> None:
    from benchmarks.report.readme_blocks import render_key

    folder = tmp_path / "vllm-peer-avx512"
    folder.mkdir()
    (folder / "mixed-stream.json").write_text(json.dumps(_peer_file([50.0], [25.0], "stream")))
    assert "| `mixed` | streamed | 64 | 1 | 50.0 | 25.0 | 2.00× (2.00) |" in render_key("vllm-peer-avx512", {}, tmp_path, Path("README.md"), "cpu")
    assert render_key("vllm-peer", {}, tmp_path, Path("README.md"), "cpu").startswith("*Not measured yet")  # not the other folder
