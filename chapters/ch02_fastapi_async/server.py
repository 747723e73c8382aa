"""Chapter 2: FastAPI on uvicorn; one dedicated inference thread computes while the event loop keeps serving."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import FastAPI

from chapters.ch02_fastapi_async.api import DisconnectCheck, Generated, create_app
from shared.devices import set_threads
from shared.generation import greedy_generate
from shared.model import GPT
from shared.schemas import ValidRequest
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.weights import load_served_model


class OneThreadBackend:
    """Every request through one model, one at a time, in one dedicated thread off the event loop."""

    def __init__(self, model: GPT, description: dict) -> None:
        self.model = model
        self.description = description
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self.served = 0

    async def start(self) -> None:
        pass

    def _run(self, request: ValidRequest, submitted: float) -> Generated:
        """Generate ``request`` in the inference thread; count it in ``served``.

        ``timings_ms``: ``queue`` from ``submitted`` (``perf_counter()`` at hand-off) to the model's start, then ``inference``.
        """
        # EXERCISE ch02.2 BEGIN "the stage timings: queue and inference, measured in the inference thread"
        started = time.perf_counter()
        output_ids = greedy_generate(self.model, request.input_ids, request.max_new_tokens)
        finished = time.perf_counter()
        self.served += 1
        return Generated(output_ids, {"queue": (started - submitted) * 1e3, "inference": (finished - started) * 1e3})

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        """Run :meth:`_run` in the one inference thread and await it; the event loop stays free while the model computes."""
        # EXERCISE ch02.1 BEGIN "moving inference off the event loop: one inference thread, awaited"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._run, request, time.perf_counter())

    def health(self) -> dict:
        return self.description

    def stats(self) -> dict:
        return {**self.description, "served": self.served}

    async def close(self) -> None:
        self._thread.shutdown(wait=True)


def build_app(settings: ServerSettings) -> FastAPI:
    set_threads(settings.torch_threads)
    loaded = load_served_model(settings)
    backend = OneThreadBackend(loaded.model, {"chapter": "ch02", "model": loaded.source})
    return create_app(
        title="ch02 FastAPI async",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        backend=backend,
    )


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch02_fastapi_async"
    settings = parse_settings(ServerSettings, argv, prog=prog)
    with refused_flags_exit(prog):  # weights it cannot serve: one line, exit 2
        app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
