"""What a start-up rule measured, kept per machine so the next start (or a replacement replica) reads it, in a JSON file named
by a digest of everything it depends on (:func:`machine_key` plus the caller's key); how such a rule judges timed rounds under
noise; and which library warnings a start leaves out. An unreadable file is measured over with a warning, never a failed start."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from shared.devices import cpu_flags

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where measured choices and compiled kernels live: ``$SFS_CACHE_DIR``, else ``serving-from-scratch`` in the user's cache."""
    if os.environ.get("SFS_CACHE_DIR"):
        return Path(os.environ["SFS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "serving-from-scratch"


def use_cache_for_compilers() -> None:
    """Point TorchInductor's cache under :func:`cache_dir` unless the user chose one (a reboot empties its default, ``/tmp``)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


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
    """``measure()``'s outcome for ``key`` (JSON, all it depends on): read from ``cache_dir()/<name>-<digest>.json`` if that
    stores an equal key and not ``remeasure``, else measured now and stored (via a renamed temporary file: never half a file)."""
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
    """A rule's choice for ``key`` from ``measure()`` (:func:`pick_within_margin`'s answer) via :func:`measured_once`, logged."""
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


UNACTIONABLE_WARNINGS = (  # (logger, message pattern, why)
    # torchao (chapter 5's int8) loads its GPU-only kernels on every import; a failure of its CPU kernels (_C.so) still warns.
    ("torchao", re.compile(r"^Failed to load \S*/_C_(mxfp8|cutlass_\w+)[^/]*\.so: "), "GPU-only kernels"),
    # Triton, a GPU compiler, is missing: irrelevant without a GPU (kept with one).
    ("torchao.kernel.intmm", re.compile(r"Detected no triton"), "no GPU"),
    # torch deprecates torchao's own registration of an Enum at import: torchao's code to change.
    ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"), "torchao's"),
)


def quiet_unactionable_warnings() -> None:
    """Drop optional libraries' start-up warnings no user can act on (:data:`UNACTIONABLE_WARNINGS`); idempotent, call first."""
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
    """Round ``round_index``'s order of turns: each round starts one further along, so a rising load hits no candidate always."""
    shift = round_index % max(1, len(names))
    return names[shift:] + names[:shift]


def pick_within_margin(samples: dict[str, list[float]], preference: tuple[str, ...], margin: float) -> dict:
    """The choice from ``samples[name][i]`` (seconds in round ``i``): in ``preference`` order, a candidate replaces the choice so
    far only if the median of its same-round time ratios to it is below ``1 / (1 + margin)``, which slow rounds barely move.
    Returns ``{"chosen", "ratio_to_first", "median_ms", "rounds_ms"}``: per candidate, its median ratio to the first."""
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
