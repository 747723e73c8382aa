"""Chapter 5's server in-process: the engine flags reach the batches, and an engine that cannot run refuses to start.

The ``cudagraph`` engine is served from the server's one pool: its static keys and values are a range
of it and each batch's cache is the engine's own, so nothing is copied per batch. On a CPU the server's
path runs with the static step uncaptured (the builder swapped for ``capture=False``); where CUDA
exists, the real captured engine goes through the same path.

The contract and the oracle's tokens under concurrency are checked by the cross-chapter tests
(``test_contract.py``, ``test_equivalence.py``) on the real process at ``--precision fp32``; the
default precision's accuracy is held to its tolerance in ``test_ch05_engines.py``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from asgi_helpers import serving
from fastapi.testclient import TestClient

from chapters.ch04_memory_pool.memory_pool import KVMemoryPool, pool_tokens_by_rule
from chapters.ch05_inference_engine.cudagraph_engine import CudaGraphEngine, StaticCacheRunner
from chapters.ch05_inference_engine.engine import EngineUnavailable, _activation_dtype
from chapters.ch05_inference_engine.engines import choose_default, pick, unavailable_reason
from chapters.ch05_inference_engine.server import EngineSettings, build_app
from shared.settings import SettingsError, parse_settings


def settings_for(*flags: str) -> EngineSettings:
    return parse_settings(EngineSettings, ["--pool-tokens", "2048", "--fallback-slots", "0", *flags])


def test_server_answers_with_a_reduced_precision_engine(oracle) -> None:
    with TestClient(build_app(settings_for("--engine", "eager", "--precision", "bf16"))) as client:
        health = client.get("/healthz").json()
        assert health["chapter"] == "ch05"
        assert (health["engine"]["engine"], health["engine"]["precision"]) == ("eager", "bf16")
        body = client.post("/v1/inference", json={"prompt": "12+34=", "max_new_tokens": 4}).json()
        assert len(body["output_ids"]) == 4
        pool = client.get("/stats").json()["pool"]
        # The pool is allocated in the engine's dtype: bf16 keys and values on a GPU, fp32 on the CPU
        # (where bf16 is used for the matrix products only).
        element = torch.tensor([], dtype=_activation_dtype("bf16", torch.device("cpu"))).element_size()
        assert pool["bytes_total"] == pool["blocks_total"] * pool["block_tokens"] * 2 * 4 * 256 * element


def test_fp32_server_returns_the_oracles_tokens(oracle) -> None:
    with TestClient(build_app(settings_for("--precision", "fp32"))) as client:
        ids = list(b"the old robot paints a ")
        body = client.post("/v1/inference", json={"input_ids": ids, "max_new_tokens": 12}).json()
        assert body["output_ids"] == oracle(ids, 12)


def test_the_default_precision_is_the_measured_choice_for_this_device(default_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("chapters.ch05_inference_engine.engines.ENGINE_CACHE_DIR", tmp_path)  # measured afresh, not read
    # This test checks what the start-up does with a measurement, not how good the measurement is:
    # one probe round and a slice of the held-out pairs keep it short (the int8 candidate dominates).
    monkeypatch.setattr("chapters.ch05_inference_engine.engines.PROBE_ROUNDS", 1)
    monkeypatch.setattr("chapters.ch05_inference_engine.engines.PROBE_PAIRS", 40)
    with TestClient(build_app(settings_for())) as client:
        engine = client.get("/healthz").json()["engine"]
    [choice_file] = tmp_path.glob("auto-choice-*.json")
    choice = json.loads(choice_file.read_text())
    assert (engine["engine"], engine["precision"]) == tuple(choice["chosen"]) == pick(choice["measured"])
    measured = {(r["engine"], r["precision"]) for r in choice["measured"]}
    assert ("eager", "fp32") in measured and all(r["requests_per_s"] > 0 for r in choice["measured"])
    if unavailable_reason("eager", "int8", default_model.model.device) is None:
        assert ("eager", "int8") in measured  # a CPU without native bf16 still gets its reduced precisions tried
    # The same choice, read back from the engine cache the server's start wrote.
    assert (engine["engine"], engine["precision"]) == choose_default(default_model.model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: TensorRT may be real here")
def test_an_engine_that_cannot_run_refuses_to_start_and_says_why() -> None:
    reason = unavailable_reason("tensorrt", "fp32", torch.device("cpu"))
    with pytest.raises(EngineUnavailable, match="tensorrt/fp32") as raised:
        build_app(settings_for("--engine", "tensorrt", "--precision", "fp32"))
    assert reason in str(raised.value)


# ---------------------------------------------------------------------------------------------
# The cudagraph engine on the server's one pool
# ---------------------------------------------------------------------------------------------

N_CTX = 512  # the default model's context
PROMPTS = [list(b"12+34="), list(b"the old robot paints a "), list(b"t"), list(b"71+28=82\n55+17="),
           list(b"hello, "), list(b"99+1="), list(b"a"), list(b"the clever fox ")]
NEW_TOKENS = [12, 5, 9, 12, 1, 6, 3, 8]


@pytest.fixture
def uncaptured_cudagraph(monkeypatch) -> tuple[list[CudaGraphEngine], list[KVMemoryPool]]:
    """The server's cudagraph path on the CPU: the engine it builds (static step uncaptured, on the pool
    the server hands it), and every pool allocated while the server starts."""
    engines: list[CudaGraphEngine] = []
    pools: list[KVMemoryPool] = []

    def build_uncaptured(model, precision, *, batch_buckets, max_len, pool):
        engines.append(CudaGraphEngine(model, precision, capture=False, batch_buckets=batch_buckets, max_len=max_len, pool=pool))
        return engines[-1]

    real_init = KVMemoryPool.__init__

    def counted_init(self, *args, **kwargs):
        pools.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr("chapters.ch05_inference_engine.engines.cudagraph_unavailable_reason", lambda precision, device: None)
    monkeypatch.setattr("chapters.ch05_inference_engine.server.build_cudagraph", build_uncaptured)
    monkeypatch.setattr(KVMemoryPool, "__init__", counted_init)
    return engines, pools


def cudagraph_settings(*flags: str) -> EngineSettings:
    """Batches of up to 4 that wait for company; the pool by chapter 4's rule for 4 requests in flight."""
    return parse_settings(EngineSettings, ["--engine", "cudagraph", "--precision", "fp32", "--fallback-slots", "0",
                                           "--max-concurrency", "4", "--max-batch", "4", "--min-batch", "4",
                                           "--window-ms", "300", *flags])


async def post_all(client: httpx.AsyncClient, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> list[httpx.Response]:
    return await asyncio.gather(*[client.post("/v1/inference", json={"input_ids": p, "max_new_tokens": n})
                                  for p, n in zip(prompts, new_tokens)])


def assert_static_buffers_are_the_pools(engine: CudaGraphEngine, pool: KVMemoryPool) -> None:
    first = pool.storage.data_ptr()
    last = first + pool.storage.numel() * pool.storage.element_size()
    for buffer in engine.static_keys + engine.static_values:
        assert buffer.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()
        assert first <= buffer.data_ptr() < last


def test_the_cudagraph_engine_serves_batches_from_the_servers_one_pool_without_copies(uncaptured_cudagraph, oracle) -> None:
    engines, pools = uncaptured_cudagraph
    app = build_app(cudagraph_settings())
    backend = app.state.backend
    [engine], [pool] = engines, pools  # one engine, one pool: the engine's static buffers are not a second allocation
    assert isinstance(backend.runner, StaticCacheRunner) and backend.runner.pool is pool and engine.pool is pool
    assert pool.capacity_tokens >= pool_tokens_by_rule(N_CTX, 4, 1.2)  # chapter 4's rule, for 4 requests in flight
    assert (engine.max_rows, engine.max_len) == (4, N_CTX)  # the largest batch at the whole context
    assert_static_buffers_are_the_pools(engine, pool)
    static_blocks = pool.blocks_for(4 * N_CTX)
    assert pool.stats().blocks_used == static_blocks

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await post_all(client)
        assert [a.status_code for a in answers] == [200] * len(PROMPTS)
        assert [a.json()["output_ids"] for a in answers] == [oracle(p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
        stats = (await client.get("/stats")).json()
        assert stats["pool"]["blocks_used"] == static_blocks and stats["pool"]["live_ranges"] == 1
        assert stats["admission"]["in_flight"] == 0

    asyncio.run(serving(app, scenario))
    assert backend.batcher.stats.batches >= 2  # several batches, each in the engine's own cache
    assert engine.stats["adoptions"] == 0 and engine.stats["eager_steps"] == 0
    assert engine.stats["uncaptured_static_steps"] > 0


def test_a_failed_batch_on_the_static_cache_leaves_only_the_static_range_and_the_next_is_served(
    uncaptured_cudagraph, oracle, monkeypatch
) -> None:
    engines, pools = uncaptured_cudagraph
    app = build_app(cudagraph_settings("--min-batch", "1", "--window-ms", "0"))
    [engine], [pool] = engines, pools
    static_blocks = pool.stats().blocks_used

    def exploding_decode(*args):
        raise RuntimeError("boom in decode")

    async def scenario(client: httpx.AsyncClient) -> None:
        with monkeypatch.context() as patch:
            patch.setattr(engine, "decode", exploding_decode)
            failed = await client.post("/v1/inference", json={"input_ids": [5, 6, 7], "max_new_tokens": 4})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "batch_failed"
        stats = (await client.get("/stats")).json()
        assert stats["pool"]["blocks_used"] == static_blocks and stats["pool"]["live_ranges"] == 1
        assert stats["admission"]["in_flight"] == 0
        served = await post_all(client, PROMPTS[:3], NEW_TOKENS[:3])
        assert [a.json()["output_ids"] for a in served] == [oracle(p, n) for p, n in zip(PROMPTS[:3], NEW_TOKENS[:3])]

    asyncio.run(serving(app, scenario))
    assert engine.stats["adoptions"] == 0 and pool.stats().blocks_used == static_blocks


def test_a_pool_that_holds_fewer_rows_than_the_largest_batch_runs_it_in_groups(uncaptured_cudagraph, oracle) -> None:
    """Two whole-context rows fit where the batcher sends four: the batch of four runs as two groups."""
    engines, pools = uncaptured_cudagraph
    app = build_app(cudagraph_settings("--pool-tokens", str(2 * N_CTX)))
    [engine], [pool] = engines, pools
    assert (engine.max_rows, engine.batch_buckets) == (2, (1, 2))

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await post_all(client, PROMPTS[:4], NEW_TOKENS[:4])
        assert [a.json()["output_ids"] for a in answers] == [oracle(p, n) for p, n in zip(PROMPTS[:4], NEW_TOKENS[:4])]

    asyncio.run(serving(app, scenario))
    assert engine.stats["adoptions"] == 0 and app.state.backend.runner.slots_reserved > 0


def test_a_pool_too_small_for_one_request_is_refused_in_one_line(uncaptured_cudagraph) -> None:
    with pytest.raises(SettingsError) as refused:
        build_app(cudagraph_settings("--pool-tokens", str(N_CTX - 1)))
    assert "\n" not in str(refused.value) and str(N_CTX) in str(refused.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; this machine has none "
                    "(the server's cudagraph path is tested above with the static step uncaptured)")
def test_the_server_serves_the_captured_engine_from_its_pool_on_cuda(oracle) -> None:
    app = build_app(cudagraph_settings("--device", "cuda"))
    runner = app.state.backend.runner
    engine = runner.model
    assert isinstance(runner, StaticCacheRunner) and engine.captured and engine.pool is runner.pool
    assert_static_buffers_are_the_pools(engine, runner.pool)

    async def scenario(client: httpx.AsyncClient) -> None:
        answers = await post_all(client)
        outputs = [a.json()["output_ids"] for a in answers]
        mismatches = [i for i, (o, p, n) in enumerate(zip(outputs, PROMPTS, NEW_TOKENS)) if o != oracle(p, n)]
        assert not mismatches, f"rows {mismatches} differ from the oracle (GPU kernels may reorder sums: measure agreement)"

    asyncio.run(serving(app, scenario))
    assert engine.stats["adoptions"] == 0 and engine.stats["graph_replays"] > 0
