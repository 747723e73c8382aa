"""Chapter 2: FastAPI on uvicorn. The event loop keeps accepting while the model computes elsewhere.

A request's life: uvicorn parses HTTP on the event loop, the endpoint checks the body, then hands
the generation to ONE dedicated inference thread and awaits it. While that thread computes, the
loop is free to accept, parse and answer other connections (health checks, errors, finished
responses). What async cannot do is make the computation itself faster: with one model and one
inference thread, requests still go through the model one at a time, now waiting in the thread's
queue instead of in the kernel's listen backlog.

Why one thread and not FastAPI's default pool: a plain ``def`` endpoint would run in a pool of 40
threads, all calling the same model at once; they would fight over the same cores (each torch
op spreading over every core) and finish later than one at a time.
"""

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
        """Generate ``request`` (in the inference thread) and say where its time went since ``submitted``.

        ``timings_ms``: ``queue`` from ``submitted`` (a ``time.perf_counter()`` reading taken when the
        request was handed to the thread) until the model starts on it, then ``inference`` until the
        model is done, both in milliseconds. Counts the request in ``served``.
        """
        # EXERCISE ch02.2 BEGIN "the stage timings: queue and inference, measured in the inference thread"
        started = time.perf_counter()
        output_ids = greedy_generate(self.model, request.input_ids, request.max_new_tokens)
        finished = time.perf_counter()
        self.served += 1
        return Generated(output_ids, {"queue": (started - submitted) * 1e3, "inference": (finished - started) * 1e3})
        # EXERCISE ch02.2 END

    async def generate(self, request: ValidRequest, is_disconnected: DisconnectCheck) -> Generated:
        """Run :meth:`_run` in the one inference thread and await it, so the event loop stays free
        (other connections, ``/healthz``) while the model computes; requests take turns in that thread."""
        # EXERCISE ch02.1 BEGIN "moving inference off the event loop: one inference thread, awaited"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._run, request, time.perf_counter())
        # EXERCISE ch02.1 END

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
