"""Chapter 6: chapter 5's server with the adaptive batcher, its knobs from ``tuned.json`` unless a flag or variable sets them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TypeVar

from fastapi import FastAPI
from pydantic import Field

from chapters.ch02_fastapi_async.api import create_app
from chapters.ch04_memory_pool.pooled_backend import CpuFallback, PooledBackend
from chapters.ch03_dynamic_batching.live_view import LiveView, request_row, serve
from chapters.ch03_dynamic_batching.server import BatcherOptions
from chapters.ch04_memory_pool.server import AdmissionOptions, PoolOptions, admission_for
from chapters.ch05_inference_engine.server import EngineOptions, runner_for
from chapters.ch06_tuned_batching.adaptive_window import AdaptiveBatcher
from shared.devices import set_threads
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.unwritten import or_meanwhile
from shared.weights import LoadedModel, load_served_model

log = logging.getLogger("chapters.ch06_tuned_batching")

TUNED_CONFIG = Path(__file__).parent / "tuned.json"
TUNED_FIELDS = ("max_batch", "min_batch", "window_ms")


class TunedBatcherOptions(BatcherOptions):
    """Chapter 3's batcher knobs, the adaptive window's floor, and the tuned file: an option group chapters 6 and 7 compose."""

    max_batch: int = Field(64, ge=1, description="most requests in one batch")
    min_batch: int = Field(16, ge=1, description="a batch leaves at once when this many requests are waiting")
    window_ms: float = Field(3.0, ge=0, description="the window under load, from the first arrival")
    min_window_ms: float = Field(1.0, ge=0, description="the window when no other request is expected within it")
    tuned_config: str = Field(str(TUNED_CONFIG), description="the autotuner's choice ('none': ignore it)")


class TunedSettings(TunedBatcherOptions, EngineOptions, PoolOptions, AdmissionOptions, ServerSettings):
    """Chapter 5's knobs with the tuned batcher's."""


TunedOptionsT = TypeVar("TunedOptionsT", bound=TunedBatcherOptions)


def apply_tuned_config(settings: TunedOptionsT) -> TunedOptionsT:
    """A copy of ``settings`` with :data:`TUNED_FIELDS` from the tuned file's ``"chosen"``, except those in ``model_fields_set``
    (a flag or an ``SFS_*`` variable); ``settings`` itself when ``tuned_config`` is ``"none"`` or the file is missing."""
    # EXERCISE ch06.3 BEGIN "the tuned file's knobs, unless a flag or an environment variable set them"
    path = Path(settings.tuned_config)
    if settings.tuned_config == "none" or not path.exists():
        return settings
    chosen = json.loads(path.read_text())["chosen"]
    updates = {name: chosen[name] for name in TUNED_FIELDS if name not in settings.model_fields_set}
    return settings.model_copy(update=updates)


def build_backend(settings: TunedSettings, loaded: LoadedModel) -> PooledBackend:
    """Chapter 5's parts, with the adaptive batcher: engine and runner over the one pool, batcher, admission, fallback."""
    runner = runner_for(settings, loaded)
    batcher = AdaptiveBatcher(runner, settings.batcher_config(), min_window_s=settings.min_window_ms / 1e3, describe_row=request_row)
    return PooledBackend(
        batcher, runner, admission_for(settings, batcher, runner.pool),
        CpuFallback(loaded.model, settings.fallback_slots) if settings.fallback_slots else None,
        {"chapter": "ch06", "model": loaded.source, "prefill": settings.prefill, "engine": runner.model.describe()},
    )


def build_app(settings: TunedSettings) -> FastAPI:
    set_threads(settings.torch_threads)
    loaded = load_served_model(settings)
    backend = build_backend(settings, loaded)
    app = create_app(
        title="ch06 tuned batching",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        backend=backend,
    )
    LiveView(lambda: backend.batcher.events).register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch06_tuned_batching"
    settings = parse_settings(TunedSettings, argv, prog=prog)
    settings = or_meanwhile(lambda: apply_tuned_config(settings), lambda: settings, "tuned.json is ignored")
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    log.info("batcher: max_batch %d, min_batch %d, window %.1f ms (min %.1f ms), from %s",
             settings.max_batch, settings.min_batch, settings.window_ms, settings.min_window_ms, settings.tuned_config)
    with refused_flags_exit(prog):  # a flag judged against the loaded model: one line, exit 2
        app = build_app(settings)
    serve(app, settings)


if __name__ == "__main__":
    main()
