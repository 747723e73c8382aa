"""Chapter 5's server in-process: the engine flags reach the batches, and an engine that cannot run refuses to start.

The contract and the oracle's tokens under concurrency are checked by the cross-chapter tests
(``test_contract.py``, ``test_equivalence.py``) on the real process at ``--precision fp32``; the
default precision's accuracy is held to its tolerance in ``test_ch05_engines.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from chapters.ch05_inference_engine.engine import EngineUnavailable, _activation_dtype
from chapters.ch05_inference_engine.engines import choose_default, pick, unavailable_reason
from chapters.ch05_inference_engine.server import EngineSettings, build_app
from shared.settings import parse_settings


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
