"""Chapter 3: dynamic batching; requests wait briefly in a queue and go through the model together, in one inference thread."""

from __future__ import annotations

import time

from fastapi import FastAPI
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from chapters.ch02_fastapi_async.api import DisconnectCheck, Generated, create_app
from chapters.ch03_dynamic_batching.batched_generation import Prefill, generate_batch
from chapters.ch03_dynamic_batching.batcher import BatcherConfig, BatchRunner, DynamicBatcher
from chapters.ch03_dynamic_batching.live_view import LiveView, request_row, serve
from shared.devices import set_threads
from shared.model import StepModel
from shared.schemas import ValidRequest
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.weights import load_served_model


class BatcherOptions(BaseSettings):
    """The batcher's three knobs and the prompt pass: an option group any server with chapter 3's batcher composes."""

    model_config = ServerSettings.model_config

    max_batch: int = Field(32, ge=1, description="most requests in one batch; the rest wait for the next one")
    min_batch: int = Field(8, ge=1, description="a batch leaves at once when this many requests are waiting")
    window_ms: float = Field(5.0, ge=0, description="longest a batch waits for company, from its first arrival")
    prefill: Prefill = Field("by_length", description="by_length: skip the padding in the prompt pass | padded: the textbook pass")

    @model_validator(mode="after")
    def _min_not_above_max(self) -> BatcherOptions:
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch ({self.min_batch}) must not exceed max_batch ({self.max_batch})")
        return self

    def batcher_config(self) -> BatcherConfig:
        return BatcherConfig(max_batch=self.max_batch, min_batch=self.min_batch, window_s=self.window_ms / 1e3)


class BatchingSettings(BatcherOptions, ServerSettings):
    """Chapter 2's knobs and the batcher's."""


class GreedyBatchRunner:
    """What the batcher runs in its thread: one padded batch through chapter 3's batched generation."""

    def __init__(self, model: StepModel, pad_id: int, prefill: Prefill) -> None:
        self.model, self.pad_id, self.prefill = model, pad_id, prefill

    def __call__(self, requests: list[ValidRequest]) -> list[Generated]:
        rows = generate_batch(
            self.model, [r.input_ids for r in requests], [r.max_new_tokens for r in requests], self.pad_id, prefill=self.prefill
        )
        return [Generated(row.output_ids, row.timings_ms) for row in rows]


class BatchedBackend:
    """Requests go through a batcher; each awaits its own result."""

    def __init__(self, batcher: DynamicBatcher[ValidRequest, Generated], description: dict) -> None:
        self.batcher = batcher
        self.description = description

    async def start(self) -> None:
        self.batcher.start()

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        submitted = time.perf_counter()
        result = await self.batcher.submit(request, is_disconnected)
        waited_ms = (time.perf_counter() - submitted) * 1e3
        return Generated(result.output_ids, {"queue": waited_ms - result.timings_ms.get("batch", 0.0), **result.timings_ms})

    def health(self) -> dict:
        return {**self.description, "batcher": self.batcher.describe()}

    def stats(self) -> dict:
        return self.health()

    async def close(self) -> None:
        await self.batcher.close()


def build_app(settings: BatchingSettings, run_batch: BatchRunner[ValidRequest, Generated] | None = None) -> FastAPI:
    """The server; ``run_batch`` replaces the model's batch function (tests inject failures with it)."""
    set_threads(settings.torch_threads)
    loaded = load_served_model(settings)
    batcher = DynamicBatcher(
        run_batch or GreedyBatchRunner(loaded.model, loaded.tokenizer.pad_id, settings.prefill), settings.batcher_config(),
        describe_row=request_row,
    )
    backend = BatchedBackend(batcher, {"chapter": "ch03", "model": loaded.source, "prefill": settings.prefill})
    app = create_app(
        title="ch03 dynamic batching",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        backend=backend,
    )
    LiveView(lambda: batcher.events).register(app)  # /ui/: the batcher's decisions, live
    return app


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch03_dynamic_batching"
    settings = parse_settings(BatchingSettings, argv, prog=prog)
    with refused_flags_exit(prog):  # weights it cannot serve: one line, exit 2
        app = build_app(settings)
    serve(app, settings)


if __name__ == "__main__":
    main()
