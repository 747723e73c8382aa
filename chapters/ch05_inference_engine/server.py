"""Chapter 5: the same server as chapter 4, with the model run by an inference engine.

A request's life is chapter 4's, unchanged: admission control, the batcher, one padded batch at a
time in the inference thread, a KV cache inside the pre-allocated pool. What changes is what
computes each prefill and decode step: an :class:`~chapters.ch05_inference_engine.engines.Engine`
chosen by ``--engine`` and ``--precision`` instead of the eager PyTorch model. The engine has the
model's call signature, so chapter 3's batched generation drives it without knowing; the pool is
allocated in the engine's dtype (16-bit keys and values, for fp16 and for bf16 on a GPU, take half the
bytes; bf16 on a CPU keeps them in fp32).

``--precision auto`` takes the fastest precision that keeps the task accuracy within 2 points of
fp32 on this kind of device (bf16 where the hardware multiplies in bf16; the README's trade-off
table has the figures), and ``--engine auto`` the fastest engine measured there. The oracle's exact
tokens are then a promise of ``--precision fp32`` only, which the cross-chapter tests use; the
default's promise is the measured accuracy. The CPU fallback path of chapter 4 stays on the eager
fp32 model: it is the slow, safe way out.
"""

from __future__ import annotations

import logging
from typing import Literal

import uvicorn
from fastapi import FastAPI
from pydantic import Field

from chapters.ch04_memory_pool.server import PoolSettings
from chapters.ch04_memory_pool.server import build_app as build_pool_app
from chapters.ch05_inference_engine.engines import Engine, build_engine
from shared.model import GPT
from shared.settings import parse_settings

log = logging.getLogger("chapters.ch05_inference_engine")


class EngineSettings(PoolSettings):
    """Chapter 4's knobs plus the engine and its precision."""

    engine: Literal["auto", "eager", "compile", "onnxruntime", "tensorrt"] = Field(
        "auto", description="what runs the model: auto = the fastest engine measured on this kind of device"
    )
    precision: Literal["auto", "fp32", "fp16", "bf16", "int8"] = Field(
        "auto", description="auto = the fastest within 2 points of fp32's task accuracy here; fp32 returns the oracle's tokens"
    )


def build_app(settings: EngineSettings, *, chapter: str = "ch05", **pool_hooks) -> FastAPI:
    """Chapter 4's server, its batches computed by the engine; fails at start-up (with the reason)
    when the engine cannot run here, rather than serving something else than was asked for.
    ``pool_hooks`` go to chapter 4's ``build_app`` (chapter 6 passes its batcher)."""

    def prepare(model: GPT) -> Engine:
        engine = build_engine(model, settings.engine, settings.precision)
        cost = engine.conversion
        log.info("engine %s on %s: ready in %.1f s%s", engine.label, engine.device, cost.seconds,
                 " (artifacts from the cache)" if cost.from_cache else "")
        return engine

    return build_pool_app(settings, chapter=chapter, prepare_model=prepare, **pool_hooks)


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(EngineSettings, argv, prog="python -m chapters.ch05_inference_engine")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
