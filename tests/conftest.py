"""Fixtures shared by the whole suite: the default model, the oracle, and real chapter servers.

Servers are started exactly as a learner starts them (``python -m chapters.<folder> --port N``) by
:func:`benchmarks.harness.server_process.running_server`, and stopped with SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from hypothesis import Phase, settings

from benchmarks.harness.server_process import RunningServer, running_server
from shared.generation import reference_greedy
from shared.weights import LoadedModel, load_model

# A failing property is reported in seconds: the suite's profile skips hypothesis's shrinking, which
# can take minutes on a stateful test. For the smallest failing example, run the failing test again
# with HYPOTHESIS_PROFILE=shrink.
settings.register_profile("suite", phases=[phase for phase in Phase if phase is not Phase.shrink])
settings.register_profile("shrink", phases=list(Phase))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# Start-up choices and compiled kernels are cached per machine (chapter 8's startup_cache.py). A run of
# the suite gets a cache of its own, inherited by every server it starts, so one run never reads what a
# run before it measured (a fresh clone must pass as if the machine were new) nor leaves files in ~/.cache.
if "SFS_CACHE_DIR" not in os.environ:
    os.environ["SFS_CACHE_DIR"] = tempfile.mkdtemp(prefix="sfs-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SFS_CACHE_DIR"], ignore_errors=True)
    # Compiled kernels are content-addressed, so sharing them is safe: they stay where torch keeps them
    # by default, not in the run's own cache (which would compile flex again on every run).
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())

# Graded exercises: the ``exercise`` marker, one ``chNN_k`` marker per exercise, ``--exercise ID``.
pytest_plugins = ("exercises.pytest_plugin",)

# The test process shares the cores with the servers it starts (and, on a small CI machine, with
# other jobs). Torch's OpenMP workers spin while they wait for a core they cannot get, which makes
# the oracle's many small operations several times slower; one thread is as fast as it gets here.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The committed default model, FP32 on the CPU: what every chapter serves by default."""
    return load_model("default")


class Oracle:
    """``reference_greedy`` on the default model, remembered per (prompt, max_new_tokens).

    Chapters are compared with the same expected tokens, so each is computed once per session.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._answers: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._answers:
            self._answers[key] = reference_greedy(self.loaded.model, prompt_ids, max_new_tokens)
        return list(self._answers[key])


@pytest.fixture(scope="session")
def oracle(default_model: LoadedModel) -> Oracle:
    return Oracle(default_model)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real model, SmolLM2-135M-Instruct from its packaged GGUF, FP32 on the CPU: ``--weights smollm2``."""
    return load_model("smollm2")


@pytest.fixture(scope="session")
def llama_oracle():
    """transformers' ``LlamaForCausalLM`` on the same GGUF file (:mod:`llama_oracle`)."""
    from llama_oracle import LlamaOracle

    from shared.weights import smollm2_path

    return LlamaOracle(smollm2_path())


# How a server may end after SIGTERM: gunicorn's master exits 0; uvicorn finishes its graceful
# shutdown and then re-raises the signal, so its parent sees "terminated by SIGTERM". A SIGKILL
# (the grace period ran out) or any other status means the server did not stop cleanly.
CLEAN_EXIT_STATUSES = (0, -signal.SIGTERM)


@contextmanager
def serve(chapter: str, *args: str) -> Iterator[RunningServer]:
    """Run ``python -m chapters.<chapter> --port <free> *args`` for the block; check it stopped cleanly."""
    with running_server(chapter, args) as running:
        yield running
    status = running.process.returncode
    assert status in CLEAN_EXIT_STATUSES, f"{chapter} did not stop cleanly on SIGTERM (status {status}):\n{running.log_tail(1500)}"


@pytest.fixture(scope="session")
def server() -> Callable[..., AbstractContextManager[RunningServer]]:
    """A factory of servers: ``with server("ch01", "--max-body-bytes", "4096") as running: ...``.

    Test modules wrap it in a module-scoped fixture parametrized over ``chapters.CHAPTERS``, so each
    chapter's server starts once per module and stops before the next chapter's starts.
    """
    return serve
