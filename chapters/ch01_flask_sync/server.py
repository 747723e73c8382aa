"""Chapter 1: a synchronous Flask app on gunicorn (run from Python), one request at a time per worker process."""

from __future__ import annotations

import os
import threading
import time

from flask import Flask
from gunicorn.app.base import BaseApplication
from pydantic import Field

from chapters.ch01_flask_sync.api import create_app
from shared.devices import set_threads
from shared.generation import greedy_generate
from shared.schemas import ValidRequest
from shared.settings import ServerSettings, parse_settings, refused_flags_exit
from shared.unwritten import or_meanwhile
from shared.weights import check_weights, load_served_model


class FlaskSyncSettings(ServerSettings):
    """Chapter 1's server: the knobs every chapter has, plus gunicorn's processes, threads and timeouts."""

    workers: int = Field(1, ge=1, description="worker processes; each loads its own copy of the model")
    threads: int = Field(1, ge=1, description="threads per worker; above 1 gunicorn uses gthread and a lock serializes the model")
    timeout: int = Field(120, ge=1, description="seconds a worker may stay silent before the master kills and replaces it")
    graceful_timeout: int = Field(30, ge=1, description="seconds workers get to finish in-flight requests after SIGTERM")
    backlog: int = Field(2048, ge=1, description="connections the kernel queues while every worker is busy")


def torch_threads_per_worker(settings: FlaskSyncSettings) -> int:
    """Intra-op threads per worker (0: torch's): ``--torch-threads`` if set, 0 for 1 worker, else cores // workers, >= 1."""
    # EXERCISE ch01.3 BEGIN "split the cores between the workers"
    if settings.torch_threads or settings.workers == 1:
        return settings.torch_threads
    return max(1, (os.cpu_count() or 1) // settings.workers)


def build_app(settings: FlaskSyncSettings) -> Flask:
    """Load the model and wrap it in the Flask app. Runs inside each worker process."""
    set_threads(or_meanwhile(lambda: torch_threads_per_worker(settings), lambda: settings.torch_threads,
                             "each worker keeps torch's default threads"))
    loaded = load_served_model(settings)
    # Uncontended with the sync worker; with --threads > 1 (gthread) it keeps the threads from running the model at once.
    model_lock = threading.Lock()

    def generate(request: ValidRequest) -> tuple[list[int], dict[str, float]]:
        waiting_since = time.perf_counter()
        with model_lock:
            started = time.perf_counter()
            output_ids = greedy_generate(loaded.model, request.input_ids, request.max_new_tokens)
        finished = time.perf_counter()
        # "queue" is the wait for the lock only; the wait in the kernel's listen backlog is visible to the client alone.
        return output_ids, {"queue": (started - waiting_since) * 1e3, "inference": (finished - started) * 1e3}

    return create_app(
        title="ch01 Flask sync",
        limits=settings.limits(loaded.config.vocab_size, loaded.config.n_ctx),
        tokenizer=loaded.tokenizer,
        generate=generate,
        health=lambda: {"chapter": "ch01", "model": loaded.source},
    )


def gunicorn_options(settings: FlaskSyncSettings) -> dict[str, object]:
    """Every gunicorn setting this chapter depends on, explicitly."""
    return {
        "bind": f"{settings.host}:{settings.port}",
        "workers": settings.workers,
        # sync: one connection at a time, no keep-alive; gthread: threads accept concurrently, then queue on the model lock.
        "worker_class": "gthread" if settings.threads > 1 else "sync",
        "threads": settings.threads,
        # A sync worker reports to the master only between requests: a generation longer than this gets it killed.
        "timeout": settings.timeout,
        "graceful_timeout": settings.graceful_timeout,
        "backlog": settings.backlog,
        # Load the model after the fork: a child forked from a process whose torch already ran can hang on its first operation.
        "preload_app": False,
        "loglevel": settings.log_level,
        "accesslog": None,  # one log line per request would cost time in the measured path
    }


class GunicornServer(BaseApplication):
    """Gunicorn's custom-application pattern: options from our settings, the app built per worker."""

    def __init__(self, settings: FlaskSyncSettings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        for name, value in gunicorn_options(self.settings).items():
            self.cfg.set(name, value)
        # Gunicorn >= 25.1 opens a control socket at a fixed path in $HOME: two servers on one machine would share it.
        if "control_socket_disable" in self.cfg.settings:
            self.cfg.set("control_socket_disable", True)

    def load(self) -> Flask:
        return build_app(self.settings)


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch01_flask_sync"
    settings = parse_settings(FlaskSyncSettings, argv, prog=prog)
    with refused_flags_exit(prog):  # weights the workers could not load: one line, exit 2, before any fork
        check_weights(settings)
    # The master handles SIGTERM: stop accepting, let workers finish for graceful_timeout, exit 0.
    GunicornServer(settings).run()


if __name__ == "__main__":
    main()
