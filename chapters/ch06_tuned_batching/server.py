"""Chapter 6: the batcher tuned. An adaptive window, a larger batch, knobs chosen by measurement.

A request's life is chapter 5's (admission control, the KV pool, the engine). Two things change:

- the batcher is :class:`~chapters.ch06_tuned_batching.adaptive_window.AdaptiveBatcher`: about 1 ms
  of waiting when no company is coming, the tuned window under load;
- ``max_batch``, ``min_batch`` and ``window_ms`` come from ``tuned.json``, which the autotuner
  (``python -m chapters.ch06_tuned_batching.autotune``) writes after sweeping them with the
  benchmark harness. Flags and ``SFS_*`` variables still override the file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from pydantic import Field

from chapters.ch03_dynamic_batching.batcher import BatcherConfig, BatchRunner
from chapters.ch05_inference_engine.server import EngineSettings
from chapters.ch05_inference_engine.server import build_app as build_engine_app
from chapters.ch06_tuned_batching.adaptive_window import AdaptiveBatcher
from shared.settings import parse_settings

log = logging.getLogger("chapters.ch06_tuned_batching")

TUNED_CONFIG = Path(__file__).parent / "tuned.json"
TUNED_FIELDS = ("max_batch", "min_batch", "window_ms")


class TunedSettings(EngineSettings):
    """Chapter 5's knobs; the batcher's defaults are the article's final ones until ``tuned.json`` says otherwise."""

    max_batch: int = Field(64, ge=1, description="most requests in one batch")
    min_batch: int = Field(16, ge=1, description="a batch leaves at once when this many requests are waiting")
    window_ms: float = Field(3.0, ge=0, description="the window under load, from the first arrival")
    min_window_ms: float = Field(1.0, ge=0, description="the window when no other request is expected within it")
    tuned_config: str = Field(str(TUNED_CONFIG), description="the autotuner's choice ('none': ignore it)")


def apply_tuned_config(settings: TunedSettings) -> TunedSettings:
    """Take the batcher's knobs from the tuned file, except those set by a flag or an environment variable."""
    path = Path(settings.tuned_config)
    if settings.tuned_config == "none" or not path.exists():
        return settings
    chosen = json.loads(path.read_text())["chosen"]
    updates = {name: chosen[name] for name in TUNED_FIELDS if name not in settings.model_fields_set}
    return settings.model_copy(update=updates)


def build_app(settings: TunedSettings) -> FastAPI:
    def make_batcher(run_batch: BatchRunner, config: BatcherConfig) -> AdaptiveBatcher:
        return AdaptiveBatcher(run_batch, config, min_window_s=settings.min_window_ms / 1e3)

    return build_engine_app(settings, chapter="ch06", make_batcher=make_batcher)


def main(argv: list[str] | None = None) -> None:
    settings = apply_tuned_config(parse_settings(TunedSettings, argv, prog="python -m chapters.ch06_tuned_batching"))
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log.info("batcher: max_batch %d, min_batch %d, window %.1f ms (min %.1f ms), from %s",
             settings.max_batch, settings.min_batch, settings.window_ms, settings.min_window_ms, settings.tuned_config)
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
