"""Benchmark profiles: which model, which loads, how long, on which cores. Every chapter gets the same one.

``smoke``  CI: a 2-3 s window per level, two levels, random weights: it checks that the harness
           works, its figures mean nothing.
``cpu``    the main job on a laptop: the embedded default model, concurrency 1/8/32/64. A level ends
           once 200 successful requests are measured (at least 6 s, at most 25 s), so every
           saturated level has a P99 sample of 200 or more.
``gpu``    the article's comparison on CUDA: the real model, SmolLM2-135M-Instruct (about GPT-2's size),
           loads 1/16/64/256, 4-12 s a level, sized for one 10-minute command on a lent GPU.
``auto``   ``gpu`` where torch sees CUDA, else ``cpu``.

``--weights`` serves other weights under a profile's loads (:func:`with_weights`): ``--weights smollm2``
on ``cpu`` measures SmolLM2-135M-Instruct, its results kept apart in ``cpu-smollm2``.

Each profile also has its open-loop sweep (:class:`OpenLoopSettings`, ``python -m benchmarks openloop``).

Fairness: every chapter of a profile runs with the same model flags, the same ``--torch-threads``
and OMP/MKL/OpenBLAS thread variables, and (where ``pin_cores``) the same cores. Pinning puts the
load generator on the last core and the server on the others, so the client never steals the
server's CPU (2 cores: server on core 0, Locust on core 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.harness.loadgen import FIRST_ROUND_ALLOWANCE_S

TINY_VOCAB = 258
SMOLLM2_VOCAB = 49152  # the packaged GGUF's vocabulary (a test reads it from the file's header)


@dataclass(frozen=True)
class OpenLoopSettings:
    """The open-loop sweep of a profile: offered rates swept upward until the server gives way.

    A rate's measured window lasts ``target_requests / rate`` seconds, kept within
    ``[min_level_s, max_level_s]``, after a ``lead_in_s`` whose arrivals are sent but not measured.
    A chapter's sweep stops after the first rate whose P99 exceeds ``stop_p99_ms`` or whose failed
    share of arrivals exceeds ``stop_error_share``: the rates above would only measure a collapse.
    """

    rates: tuple[float, ...]  # offered requests per second, increasing
    min_level_s: float
    max_level_s: float
    target_requests: int
    lead_in_s: float
    drain_s: float
    max_outstanding: int  # requests in flight at most; an arrival beyond is dropped (a failure)
    slo_ms: float  # goodput: successful requests answered within this
    stop_p99_ms: float
    stop_error_share: float

    def window_s(self, rate: float) -> float:
        return min(self.max_level_s, max(self.min_level_s, self.target_requests / rate))


@dataclass(frozen=True)
class Profile:
    name: str
    levels: tuple[int, ...]  # closed-loop users = requests in flight
    min_level_s: float  # a level never stops earlier (after its last user started) ...
    max_level_s: float  # ... nor later
    target_requests: int  # ... and stops early once this many successful requests were measured
    model_args: tuple[str, ...]  # model and device flags, identical for every chapter
    vocab_size: int  # responses' ids must lie in [0, vocab_size)
    torch_threads: int
    pin_cores: bool
    server_core_budget: int | None  # cores given to the server when pinned; None: all but the load generator's
    warmup_requests: int
    request_timeout_s: float = 120.0
    first_round_s: float = FIRST_ROUND_ALLOWANCE_S  # a level fails unless every user has a first answer within this
    extra_env: tuple[tuple[str, str], ...] = ()  # more settings for every server, as SFS_* variables
    open_loop: OpenLoopSettings | None = None  # the open-loop sweep (python -m benchmarks openloop)
    model: str = ""  # the served weights' short name where they are not the profile's own (with_weights)

    @property
    def results_name(self) -> str:
        """The folder of this profile's results: its name, then the model's where it serves other weights."""
        return f"{self.name}-{self.model}" if self.model else self.name

    def thread_env(self) -> dict[str, str]:
        """Thread variables for the server: native libraries must not spread beyond the budget either."""
        n = str(self.torch_threads)
        return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}

    def server_env(self) -> dict[str, str]:
        """Everything the server's environment gets: the thread variables, then ``extra_env``.

        Settings go here rather than in ``model_args`` when only some chapters have them (an
        ``SFS_*`` variable a chapter does not know is ignored; an unknown flag is an error).
        """
        return {**self.thread_env(), **dict(self.extra_env)}

    def server_args(self) -> list[str]:
        return [*self.model_args, f"--torch-threads={self.torch_threads}"]

    def core_plan(self, available: list[int] | None = None) -> tuple[list[int] | None, list[int] | None]:
        """``(server_cores, loadgen_cores)``; ``(None, None)`` when not pinning or with fewer than 2 cores."""
        available = sorted(available if available is not None else _usable_cores())
        if not self.pin_cores or len(available) < 2:
            return None, None
        loadgen = available[-1:]
        others = available[:-1]
        server = others if self.server_core_budget is None else others[: self.server_core_budget]
        return server, loadgen


def _usable_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def build_profiles() -> dict[str, Profile]:
    """The profiles."""
    return {
        "smoke": Profile(
            name="smoke", levels=(1, 4), min_level_s=2.0, max_level_s=3.0, target_requests=10,
            model_args=("--weights=dummy", "--preset=tiny", "--device=cpu"), vocab_size=TINY_VOCAB,
            torch_threads=1, pin_cores=True, server_core_budget=1, warmup_requests=4,
            open_loop=OpenLoopSettings(
                rates=(2.0, 8.0), min_level_s=2.0, max_level_s=3.0, target_requests=10, lead_in_s=0.5,
                drain_s=5.0, max_outstanding=64, slo_ms=2000.0, stop_p99_ms=10_000.0, stop_error_share=0.5,
            ),
        ),
        "cpu": Profile(
            name="cpu", levels=(1, 8, 32, 64), min_level_s=6.0, max_level_s=25.0, target_requests=200,
            model_args=("--weights=default", "--device=cpu"), vocab_size=TINY_VOCAB,
            torch_threads=1, pin_cores=True, server_core_budget=1, warmup_requests=8,
            # 6-12 s a rate, each chapter's sweep stopping once it gives way.
            open_loop=OpenLoopSettings(
                rates=(2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0), min_level_s=6.0, max_level_s=12.0,
                target_requests=150, lead_in_s=1.0, drain_s=8.0, max_outstanding=256, slo_ms=1000.0,
                stop_p99_ms=3000.0, stop_error_share=0.05,
            ),
        ),
        "gpu": Profile(
            # Sized so the whole climb fits one 10-minute command on a lent GPU machine.
            name="gpu", levels=(1, 16, 64, 256), min_level_s=4.0, max_level_s=12.0, target_requests=300,
            model_args=("--weights=smollm2", "--device=cuda"), vocab_size=SMOLLM2_VOCAB,
            # The model runs on the GPU; CPU threads only feed it, and one per process avoids oversubscription.
            torch_threads=1, pin_cores=True, server_core_budget=None, warmup_requests=16,
            # Chapter 4's pool is sized for the top load (its rule: longest sequence x concurrency x 1.2),
            # not for its default 64, which would turn 256 users into 429s instead of a measurement.
            # Chapter 8 likewise runs as many sequences at once as the top load sends (its default is 64).
            extra_env=(("SFS_MAX_CONCURRENCY", "256"), ("SFS_MAX_NUM_SEQS", "256")),
            open_loop=OpenLoopSettings(
                rates=(10.0, 25.0, 50.0, 100.0, 150.0, 200.0, 300.0, 400.0), min_level_s=4.0, max_level_s=8.0,
                target_requests=300, lead_in_s=1.0, drain_s=8.0, max_outstanding=512, slo_ms=500.0,
                stop_p99_ms=2000.0, stop_error_share=0.05,
            ),
        ),
    }


PROFILE_NAMES = ("smoke", "cpu", "gpu", "auto")


def resolve_profile_name(name: str) -> str:
    """``auto`` -> ``gpu`` where CUDA is available, else ``cpu``; other names pass through (checked)."""
    if name not in PROFILE_NAMES:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILE_NAMES)}")
    if name != "auto":
        return name
    import torch  # imported here: only auto needs it, and it takes a second to import

    return "gpu" if torch.cuda.is_available() else "cpu"


def weights_name(weights: str) -> str:
    """A short name for ``--weights``: ``smollm2``, or a file's or directory's own name without its suffix."""
    return weights if weights in ("smollm2", "dummy", "default") else Path(weights).stem or Path(weights).name


# How long a real model's first round and answer may take (chapter 1 answers 64 users one at a time). A bound,
# not a duration: a faster server never waits it.
REAL_MODEL_WAIT_S = 300.0


def with_weights(profile: Profile, weights: str | None) -> Profile:
    """``profile`` serving ``weights`` under the same loads: answers checked against that model's vocabulary,
    results named for it, and as long for a first round and an answer as :data:`REAL_MODEL_WAIT_S`.
    ``None`` or the profile's own weights: ``profile`` itself."""
    args = [a for a in profile.model_args if not a.startswith("--weights")]
    if weights is None or f"--weights={weights}" in profile.model_args:
        return profile
    from shared.weights import weights_config

    preset = next((a.split("=", 1)[1] for a in args if a.startswith("--preset=")), "tiny")
    return replace(profile, model_args=(*args, f"--weights={weights}"), model=weights_name(weights),
                   vocab_size=weights_config(weights, preset).vocab_size,
                   first_round_s=max(profile.first_round_s, REAL_MODEL_WAIT_S),
                   request_timeout_s=max(profile.request_timeout_s, REAL_MODEL_WAIT_S))


def get_profile(name: str, weights: str | None = None) -> Profile:
    """The profile ``name`` (``auto`` resolved), serving ``weights`` where given (:func:`with_weights`)."""
    return with_weights(build_profiles()[resolve_profile_name(name)], weights)
