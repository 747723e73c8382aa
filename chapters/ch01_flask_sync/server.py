"""Chapter 1: a synchronous Flask app on gunicorn. One request at a time per worker process.

A request's life here: the kernel accepts the TCP connection into the listen backlog; a gunicorn
worker takes it when it is free, parses HTTP and calls Flask; the handler checks the body, runs the
whole generation, writes the response and closes the connection; only then does the worker take
the next connection. While the model computes, nobody accepts, parses or answers anything else:
every other client waits in the kernel's backlog, invisible to the server and to its timings.

The configuration is spelled out in :func:`gunicorn_options`, each knob with why it is set so.
Gunicorn is started from Python through its documented custom-application pattern
(``gunicorn.app.base.BaseApplication``), so ``python -m chapters.ch01_flask_sync --port N`` starts
it like every other chapter, with typed flags and no separate config file.
"""

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
    """Intra-op threads for each worker's model (0: torch's default, every core).

    With several workers and torch's default, each worker would spread every matrix product over
    every core, and N workers would fight over the same cores. Unless told otherwise, split them:
    an explicit ``--torch-threads`` wins; one worker keeps torch's default (0); N workers get
    ``os.cpu_count() // N`` each, at least 1.
    """
    # EXERCISE ch01.3 BEGIN "split the cores between the workers"
    if settings.torch_threads or settings.workers == 1:
        return settings.torch_threads
    return max(1, (os.cpu_count() or 1) // settings.workers)
    # EXERCISE ch01.3 END


def build_app(settings: FlaskSyncSettings) -> Flask:
    """Load the model and wrap it in the Flask app. Runs inside each worker process."""
    set_threads(or_meanwhile(lambda: torch_threads_per_worker(settings), lambda: settings.torch_threads,
                             "each worker keeps torch's default threads"))
    loaded = load_served_model(settings)
    # With the sync worker there is one thread and the lock is never contended. With --threads > 1
    # (gthread) it is what keeps those threads from running the model at the same time: they would
    # only compete for the same cores (and on a GPU for the same stream) and all finish later.
    model_lock = threading.Lock()

    def generate(request: ValidRequest) -> tuple[list[int], dict[str, float]]:
        waiting_since = time.perf_counter()
        with model_lock:
            started = time.perf_counter()
            output_ids = greedy_generate(loaded.model, request.input_ids, request.max_new_tokens)
        finished = time.perf_counter()
        # "queue" only sees the wait for the lock (other threads of this worker). The wait in the
        # kernel's listen backlog happens before the request exists for us: only the client sees it.
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
        # One worker process holding one model, as one would run one per GPU. More workers answer
        # more requests at once, but each loads its own copy of the model (memory) and they share
        # the same cores (contention): the lesson's workers comparison measures both.
        "workers": settings.workers,
        # sync: one thread per worker, one connection at a time, no keep-alive. gthread: a pool of
        # threads per worker that accept concurrently, but here they queue on the model lock.
        "worker_class": "gthread" if settings.threads > 1 else "sync",
        "threads": settings.threads,
        # A sync worker reports to the master only between requests, so a single generation longer
        # than this gets the worker killed (and its model reloaded): keep it above the slowest one.
        "timeout": settings.timeout,
        # After SIGTERM the master stops accepting, lets workers finish what they hold for this
        # long, then kills them.
        "graceful_timeout": settings.graceful_timeout,
        # Where clients wait while every worker is busy: at 50 concurrent clients, 49 sit here.
        "backlog": settings.backlog,
        # Load the model in each worker after the fork, never in the master before it. Forking a
        # process whose torch already ran an operation copies a thread pool (OpenMP, CUDA context)
        # without its threads, and the child can hang or crash on its first operation. The master
        # imports torch but never runs it.
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
        # Gunicorn >= 25.1 opens a control socket at a fixed path in $HOME by default; two servers
        # on one machine (tests, the harness) would fight over it. Older versions have no such knob.
        if "control_socket_disable" in self.cfg.settings:
            self.cfg.set("control_socket_disable", True)

    def load(self) -> Flask:
        # Called in each worker after the fork (preload_app is off), so each worker owns its model.
        return build_app(self.settings)


def main(argv: list[str] | None = None) -> None:
    prog = "python -m chapters.ch01_flask_sync"
    settings = parse_settings(FlaskSyncSettings, argv, prog=prog)
    with refused_flags_exit(prog):  # weights the workers could not load: one line, exit 2, before any fork
        check_weights(settings)
    # The master handles SIGTERM itself: stop accepting, let workers finish, exit 0.
    GunicornServer(settings).run()


if __name__ == "__main__":
    main()
