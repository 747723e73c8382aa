"""Start a chapter's server as a real process on a free loopback port, wait until it answers, stop it with SIGTERM.

The tests and the harness both start servers this way, exactly as a learner does:
``python -m chapters.<folder> --port N``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests

from chapters import module_for
from shared.paths import REPO_ROOT


def free_port() -> int:
    """A port nobody listens on right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    chapter: str
    url: str
    process: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:]


def _wait_until_healthy(server: RunningServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.chapter} exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)  # polling a process we do not control: there is no event to await
    raise TimeoutError(f"{server.chapter} did not answer /healthz within {timeout_s} s:\n{server.log_tail()}")


def stop(server: RunningServer, grace_s: float = 20.0) -> int:
    """SIGTERM, wait for a graceful exit, SIGKILL past ``grace_s``; returns the exit code."""
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@contextmanager
def running_server(
    chapter: str,
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    cpu_cores: Sequence[int] | None = None,
    startup_timeout_s: float = 180.0,
    log_path: Path | None = None,
) -> Iterator[RunningServer]:
    """Run ``python -m chapters.<chapter> --port <free> *args`` for the duration of the block.

    ``cpu_cores`` pins the server (and every process it forks) to those cores, where the OS allows.
    """
    with running_module(
        module_for(chapter), args, name=chapter, env=env, cpu_cores=cpu_cores,
        startup_timeout_s=startup_timeout_s, log_path=log_path,
    ) as server:
        yield server


def server_command(module: str, port: int, args: Sequence[str] = ()) -> list[str]:
    """The exact command line a server is started with (the harness records it)."""
    return [sys.executable, "-m", module, "--port", str(port), *args]


def pin_to_cores(cpu_cores: Sequence[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that pins the child to ``cpu_cores``; ``None`` where there is nothing to pin."""
    if not cpu_cores or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, set(cpu_cores))


@contextmanager
def running_module(
    module: str,
    args: Sequence[str] = (),
    *,
    name: str | None = None,
    env: dict[str, str] | None = None,
    cpu_cores: Sequence[int] | None = None,
    startup_timeout_s: float = 180.0,
    log_path: Path | None = None,
) -> Iterator[RunningServer]:
    """Like :func:`running_server` for any module that takes ``--port`` and answers ``GET /healthz``.

    The harness's ceiling server (``benchmarks.harness.trivial_server``) is started this way.
    """
    name = name or module.rsplit(".", 1)[-1]
    port = free_port()
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            server_command(module, port, args), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, preexec_fn=pin_to_cores(cpu_cores),
        )
    server = RunningServer(
        chapter=name, url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, command=list(process.args)
    )
    try:
        _wait_until_healthy(server, startup_timeout_s)
        yield server
    finally:
        stop(server)
