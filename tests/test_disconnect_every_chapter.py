"""Every batching chapter's backend drops a request whose client has already gone, without computing it.

Chapter 3 teaches it (the batcher asks each request's disconnect check before it joins a batch);
every later chapter composes that backend with more around it, and each layer must pass the
client's check down. A layer that passes ``None`` instead (or polls only after the work is done)
computes for nobody: here the check says "gone" from the start, the model counts its forward
passes, and the answer must be 499 with no pass made.
"""

from __future__ import annotations

import asyncio

import pytest

from chapters.ch03_dynamic_batching.server import BatchingSettings
from chapters.ch03_dynamic_batching.server import build_app as build_ch03
from chapters.ch04_memory_pool.server import PoolSettings
from chapters.ch04_memory_pool.server import build_app as build_ch04
from chapters.ch05_inference_engine.server import EngineSettings
from chapters.ch05_inference_engine.server import build_app as build_ch05
from chapters.ch06_tuned_batching.server import TunedSettings
from chapters.ch06_tuned_batching.server import build_app as build_ch06
from chapters.ch07_production.server import ProductionSettings
from chapters.ch07_production.server import build_app as build_ch07
from shared.model import GPT
from shared.schemas import ApiError, ValidRequest

COMMON = {"weights": "dummy", "device": "cpu", "min_batch": 1, "max_batch": 1, "window_ms": 0}
ENGINE = {"engine": "eager", "precision": "fp32", "fallback_slots": 0}
CHAPTERS = {
    "ch03": lambda: build_ch03(BatchingSettings(**COMMON)),
    "ch04": lambda: build_ch04(PoolSettings(**COMMON, fallback_slots=0)),
    "ch05": lambda: build_ch05(EngineSettings(**COMMON, **ENGINE)),
    "ch06": lambda: build_ch06(TunedSettings(**COMMON, **ENGINE, tuned_config="none")),
    "ch07": lambda: build_ch07(ProductionSettings(**COMMON, **ENGINE, tuned_config="none", probe_interval_s=3600)),
}


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_a_request_whose_client_is_gone_is_answered_499_and_never_computed(chapter: str, monkeypatch) -> None:
    forward_passes = []
    original = GPT.forward

    def counted(self, *args, **kwargs):
        forward_passes.append(1)
        return original(self, *args, **kwargs)

    app = CHAPTERS[chapter]()
    backend = app.state.backend

    async def gone() -> bool:
        return True

    async def scenario() -> None:
        await backend.start()
        try:
            production = getattr(app.state, "production", None)
            if production is not None:  # chapter 7's readiness probe runs a real pass at start: not the request's
                await production.probe.passed.wait()
            monkeypatch.setattr(GPT, "forward", counted)
            with pytest.raises(ApiError) as refused:
                await backend.generate(ValidRequest([7, 1, 3], 4), gone)
            assert refused.value.status == 499, refused.value
        finally:
            await backend.close()

    asyncio.run(scenario())
    assert forward_passes == [], f"{chapter} computed {len(forward_passes)} forward passes for a client that had left"
