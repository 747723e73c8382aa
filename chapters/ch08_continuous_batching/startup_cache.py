"""What a start-up rule measured, kept per machine, so the next start (or a replacement replica) reads it;
how such a rule judges its timed rounds under noise; and which library warnings a start leaves out.

A rule that times candidates at start (chapter 8's decode attention,
:mod:`~chapters.ch08_continuous_batching.attention_choice`) is only right for the machine, software
and settings it ran under. :func:`measured_once` stores its outcome in a JSON file named by a digest
of exactly those (:func:`machine_key` plus what the caller adds: the model's shape, precision, the
pool, the candidates, the rule's text), so a changed key measures again and an unchanged one does not.

The API (chapter 9's replicas get all of it through chapter 8's ``build_app``; another rule that
measures at start can use it the same way)::

    cache_dir()                    # $SFS_CACHE_DIR, else ~/.cache/serving-from-scratch ($XDG_CACHE_HOME's)
    use_cache_for_compilers()      # TorchInductor's kernels under cache_dir()/inductor (before compiling)
    machine_key()                  # CPU model and the vector flags that matter, torch, ATen's capability, threads
    model_key(model)               # the model's shape and its layers' types and dtypes
    measured_once(name, key, measure, remeasure=False) -> Measured
                                   # the cached outcome for this key, or measure() now, stored atomically
    choose_once(what, key, measure, remeasure=False) -> str
                                   # measured_once for a rule's choice, and the log line saying which and why
    round_order(names, i)          # a probe's turns: candidates interleaved, each round starting one further on
    pick_within_margin(samples, preference, margin)
                                   # the choice from timed rounds: medians of same-round ratios, a margin
    quiet_unactionable_warnings()  # drop the optional libraries' start-up warnings nobody can act on

The C decode kernel is built into ``cache_dir()`` too
(:func:`~chapters.ch08_continuous_batching.attention_kernel.build_kernel`), so every process on a
machine, every replica of an application included, reuses what the first one built and measured.
A cache file that cannot be read is reported with a warning and measured over, never a failed start.
Chapter 5's engine rule keeps its own measured choice beside its converted engines
(``SFS_ENGINE_CACHE``, :mod:`~chapters.ch05_inference_engine.engines`), which every process of a
checkout shares as well.
``--remeasure-attention`` (``SFS_REMEASURE_ATTENTION=1``) measures again and replaces the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The CPU features a measured choice depends on: vector widths and matrix units. Others (virtualization,
# security mitigations) differ between identical machines and would only make the cache miss.
RELEVANT_CPU_FLAGS = ("avx", "amx", "fma", "f16c", "sse4", "asimd", "sve", "neon", "bf16", "fp16")


def cache_dir() -> Path:
    """Where measured choices and compiled kernels live: ``$SFS_CACHE_DIR``, else ``serving-from-scratch`` under
    ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get("SFS_CACHE_DIR"):
        return Path(os.environ["SFS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serving-from-scratch"


def use_cache_for_compilers() -> None:
    """Point TorchInductor's on-disk cache under :func:`cache_dir` unless the user chose one (``TORCHINDUCTOR_CACHE_DIR``).

    Its default lives in ``/tmp``, which a reboot or a container's restart empties: then every start compiles again.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def cpu_flags(every: bool = False) -> list[str]:
    """The CPU's feature flags that a measured choice depends on (:data:`RELEVANT_CPU_FLAGS`), or ``every`` one, sorted."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return [platform.machine()]
    line = next((line for line in text.splitlines() if line.lower().startswith(("flags", "features"))), ":")
    return sorted({flag for flag in line.split(":", 1)[1].split() if every or flag.startswith(RELEVANT_CPU_FLAGS)})


def machine_key() -> dict:
    """What makes a measurement on this machine valid elsewhere: the same CPU model and flags, torch, threads, GPU."""
    from shared.devices import processor_name

    return {"cpu": processor_name(torch.device("cpu")), "cpu_flags": cpu_flags(), "torch": torch.__version__,
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def model_key(model: object) -> dict:
    """What a measurement of ``model`` depends on: its type and shape (``model.config``) and what its layers hold (types, dtypes)."""
    config, modules = getattr(model, "config", None), model.modules() if isinstance(model, torch.nn.Module) else []
    return {"model": type(model).__name__, "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config),
            "weights": sorted({f"{type(m).__name__}:{p.dtype}" for m in modules for p in m.parameters(recurse=False)})}


@dataclass(frozen=True)
class Measured:
    """A rule's outcome: ``result`` (what ``measure`` returned), when it was measured, and from where it came."""

    result: dict
    measured_at: str
    path: Path
    from_cache: bool


def measured_once(name: str, key: dict, measure: Callable[[], dict], remeasure: bool = False) -> Measured:
    """``measure()``'s outcome for ``key``: read from ``cache_dir()/<name>-<digest of key>.json``, or measured now and stored.

    ``key`` must hold everything the outcome depends on (JSON-serializable); it is stored beside the
    result, and a file whose stored key differs (a digest collision, a hand edit) is measured over.
    ``remeasure`` measures even when a file exists. The file is written to a temporary name and
    renamed, so two processes measuring at once never leave half a file, and the last one wins.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / f"{name}-{digest}.json"
    if not remeasure and path.exists():
        try:
            stored = json.loads(path.read_text())
            if stored["key"] == json.loads(json.dumps(key)) and isinstance(stored["result"], dict):
                return Measured(stored["result"], str(stored["measured_at"]), path, from_cache=True)
            log.warning("%s holds another key than this start's; measuring again", path)
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("ignoring the unreadable cached choice %s (%s: %s); measuring again", path, type(error).__name__, error)
    result = measure()
    measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": key, "measured_at": measured_at, "result": result}, indent=1))
        os.replace(partial, path)
    except OSError as error:  # a read-only home: serve what was measured, measure again next time
        log.warning("could not store the measured choice in %s (%s); the next start measures again", path, error)
    return Measured(result, measured_at, path, from_cache=False)


def choose_once(what: str, key: dict, measure: Callable[[], dict], remeasure: bool = False) -> str:
    """A start-up rule's choice for ``key``, cached (:func:`measured_once` under ``<what>-choice``), and one log line saying which.

    ``measure()`` returns ``{"chosen": name, "median_ms": {candidate: milliseconds}, ...}``
    (:func:`pick_within_margin`'s answer); its duration is stored beside, as ``"seconds"``.
    """
    def timed() -> dict:
        started = time.perf_counter()
        return {**measure(), "seconds": time.perf_counter() - started}

    measured = measured_once(f"{what}-choice", key, timed, remeasure)
    chosen, times = measured.result["chosen"], ", ".join(f"{n} {t:.1f} ms" for n, t in measured.result["median_ms"].items())
    if measured.from_cache:
        log.info("%s %s: using cached choice from %s (measured %s): %s", what, chosen, measured.path, measured.measured_at, times)
    else:
        log.info("%s %s, by the rule over: %s (measured in %.0f s; stored in %s)", what, chosen, times,
                 measured.result["seconds"], measured.path)
    return chosen


# Warnings that optional libraries log at a start and that a user of this server can do nothing about:
# (logger, a pattern of the message, why it is dropped). Every other warning of theirs still shows.
UNACTIONABLE_WARNINGS = (
    # torchao (chapter 5's int8) tries to load its GPU-only kernels (MX fp8, CUTLASS for Hopper) on every import;
    # they are unused on the CPU. A failure of its CPU kernels (_C.so) is not matched and still warns.
    ("torchao", re.compile(r"^Failed to load \S*/_C_(mxfp8|cutlass_\w+)[^/]*\.so: "), "GPU-only kernels"),
    # torchao's int8 matmul notes that Triton, a GPU compiler, is missing: irrelevant without a GPU (kept with one).
    ("torchao.kernel.intmm", re.compile(r"Detected no triton"), "no GPU"),
    # torch deprecates torchao's own registration of an Enum at import: torchao's code to change, not the user's.
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"), "torchao's"),
)


def quiet_unactionable_warnings() -> None:
    """Drop the :data:`UNACTIONABLE_WARNINGS` (each by its logger and message); idempotent. Call before the engine loads."""
    for logger_name, pattern, why in UNACTIONABLE_WARNINGS:
        if why == "no GPU" and torch.cuda.is_available():
            continue
        logger = logging.getLogger(logger_name)
        if not any(getattr(f, "pattern", None) is pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.WARNING or not self.pattern.search(record.getMessage())


def round_order(names: list[str], round_index: int) -> list[str]:
    """The order candidates take their turns in round ``round_index`` of a probe: each round starts one further along,
    so a load that rises during a round does not always fall on the same candidate."""
    shift = round_index % max(1, len(names))
    return names[shift:] + names[:shift]


def pick_within_margin(samples: dict[str, list[float]], preference: tuple[str, ...], margin: float) -> dict:
    """The choice from timed rounds: in ``preference`` order (others after it), a candidate replaces the choice so far
    only if its times, round by round, divided by that choice's, have a median below ``1 / (1 + margin)``.

    ``samples[name][i]`` is candidate ``name``'s seconds in round ``i`` (every candidate timed once per
    round, in turns). Two candidates are compared within each round, where they ran a moment apart, so
    a slowdown that lasts a round or more cancels out; the median over rounds ignores the rounds a burst
    of load spoiled, while they are fewer than half. Only the two compared enter a ratio: a third
    candidate's bad moment does not move it. Returns ``{"chosen", "ratio_to_first", "median_ms",
    "rounds_ms"}``: the choice, and per candidate its median ratio to the first candidate's time in
    the same round, its median and every round's milliseconds.
    """
    def median_ratio(name: str, to: str) -> float:
        return statistics.median(t / max(u, 1e-12) for t, u in zip(samples[name], samples[to]))

    order = sorted(samples, key=lambda name: preference.index(name) if name in preference else len(preference))
    chosen = order[0]
    for name in order[1:]:
        if median_ratio(name, chosen) * (1 + margin) < 1:
            chosen = name
    return {"chosen": chosen, "ratio_to_first": {name: median_ratio(name, order[0]) for name in order},
            "median_ms": {n: statistics.median(s) * 1e3 for n, s in samples.items()},
            "rounds_ms": {n: [t * 1e3 for t in s] for n, s in samples.items()}}
