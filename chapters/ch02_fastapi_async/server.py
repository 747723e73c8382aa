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

from chapters.ch02_fastapi_async.api import Generated, create_app
from shared.devices import choose_device, set_threads
from shared.generation import greedy_generate
from shared.schemas import ValidRequest
from shared.settings import ServerSettings, parse_settings
from shared.weights import load_model


def build_app(settings: ServerSettings):
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    inference_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")

    def run_model(request: ValidRequest, submitted: float) -> Generated:
        started = time.perf_counter()
        output_ids = greedy_generate(loaded.model, request.input_ids, request.max_new_tokens)
        finished = time.perf_counter()
        return Generated(output_ids, {"queue": (started - submitted) * 1e3, "inference": (finished - started) * 1e3})

    async def generate(request: ValidRequest, is_disconnected) -> Generated:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(inference_thread, run_model, request, time.perf_counter())

    return create_app(
        title="ch02 FastAPI async",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        generate=generate,
        health=lambda: {"chapter": "ch02", "model": loaded.source},
    )


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(ServerSettings, argv, prog="python -m chapters.ch02_fastapi_async")
    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)


if __name__ == "__main__":
    main()
