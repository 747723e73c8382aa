"""Which engine and precision serve: every engine by name, and the rule that picks the default.

``auto`` for both ``--engine`` and ``--precision`` applies :data:`RULE` (:func:`choose_default`), measured at the first
start and kept in the engine cache, keyed by the weights, the processor, torch's version, the thread count and the rule;
``auto`` beside a named one means eager or fp32, the baseline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from chapters.ch03_dynamic_batching.batched_generation import batched_greedy
from chapters.ch05_inference_engine.compiled_engine import build_compiled, compiler_available
from chapters.ch05_inference_engine.cudagraph_engine import build_cudagraph, cudagraph_unavailable_reason
from chapters.ch05_inference_engine.engine import (
    ENGINES,
    PRECISIONS,
    Engine,
    EngineUnavailable,
    build_eager,
    multiplies_in_bf16,
    torchao_missing_reason,
)
from chapters.ch05_inference_engine.onnx_engine import (
    _onnx_precision_reason,
    build_onnxruntime,
    onnxruntime_missing_reason,
    weights_fingerprint,
)
from chapters.ch05_inference_engine.tensorrt_engine import build_tensorrt, tensorrt_missing_reason
from shared.corpus import HELD_OUT_PAIRS, evaluate
from shared.devices import processor_name
from shared.model import DecoderModel
from shared.paths import ENGINE_CACHE_DIR

log = logging.getLogger(__name__)

RULE = (
    "Measure, on this machine, every candidate that can run here (CANDIDATES; not a bf16 one that computes as fp32 "
    "here), in turns: its decode throughput on a "
    "batch like the server's, and its accuracy on the embedded model's held-out arithmetic task. Serve the "
    "fastest candidate whose accuracy is within ACCURACY_TOLERANCE of fp32 eager's and whose throughput beats "
    "fp32 eager's by at least MIN_SPEEDUP; if none does, serve fp32 eager (the oracle's exact tokens)."
)

BUILDERS: dict[str, Callable[[DecoderModel, str], Engine]] = {
    "eager": build_eager, "compile": build_compiled, "onnxruntime": build_onnxruntime, "tensorrt": build_tensorrt,
    "cudagraph": build_cudagraph,
}

# What ``auto`` measures: not torch.compile (it pays its compilation at every start), nor ONNX Runtime on the CPU (README).
CANDIDATES = {
    "cpu": (("eager", "fp32"), ("eager", "bf16"), ("eager", "int8")),
    "cuda": (("eager", "fp32"), ("eager", "fp16"), ("eager", "bf16"), ("tensorrt", "fp16"), ("tensorrt", "fp32"),
             ("cudagraph", "fp16"), ("cudagraph", "fp32")),
}
ACCURACY_TOLERANCE = 0.02  # task accuracy a reduced precision may lose against fp32 (2 points)
MIN_SPEEDUP = 1.10  # a candidate must beat fp32 eager by more than noise to give up the oracle's exact tokens
PROBE_BATCH, PROBE_PROMPT, PROBE_STEPS, PROBE_PAIRS, PROBE_ROUNDS = 32, 32, 8, 300, 3


def unavailable_reason(engine: str, precision: str, device: torch.device) -> str | None:
    """Why ``engine`` at ``precision`` cannot run on ``device``, or None when it should (imports and device checks only:
    building can still fail). Raises ValueError for an unknown engine or precision."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    if engine == "tensorrt":
        return tensorrt_missing_reason(device)
    if engine == "cudagraph":  # graphs record CUDA kernel launches: there is nothing to record on a CPU
        return cudagraph_unavailable_reason(precision, device)
    if engine == "onnxruntime":
        return onnxruntime_missing_reason() or _onnx_precision_reason(precision, device)
    if engine == "compile" and not compiler_available():
        return "torch.compile needs a C++ compiler on the CPU (none found on PATH)"
    if precision == "int8":
        return torchao_missing_reason()
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    return None


def resolve_engine(model: DecoderModel, engine: str = "auto", precision: str = "auto") -> tuple[str, str]:
    """The engine and precision ``engine`` and ``precision`` name for ``model`` (``auto`` for both: :func:`choose_default`;
    for one: eager, or fp32); raises :class:`EngineUnavailable`, with the reason, when that engine cannot run here."""
    if engine == "auto" and precision == "auto":
        engine, precision = choose_default(model)
    engine, precision = ("eager" if engine == "auto" else engine), ("fp32" if precision == "auto" else precision)
    reason = unavailable_reason(engine, precision, model.device)
    if reason:
        raise EngineUnavailable(f"{engine}/{precision}: {reason}")
    return engine, precision


def build_engine(model: DecoderModel, engine: str = "auto", precision: str = "auto") -> Engine:
    """The engine :func:`resolve_engine` names, built for ``model``."""
    engine, precision = resolve_engine(model, engine, precision)
    return BUILDERS[engine](model, precision)


def choose_default(model: DecoderModel) -> tuple[str, str]:
    """:data:`RULE`'s pick, from the cached measurement when there is one; fp32 eager, unmeasured, for a model the rule's
    accuracy task cannot score (:func:`accuracy_task_missing`)."""
    missing = accuracy_task_missing(model)
    if missing:
        log.info("auto engine: eager/fp32, nothing measured: %s", missing)
        return "eager", "fp32"
    device = model.device
    candidates = [(e, p) for e, p in CANDIDATES.get(device.type, CANDIDATES["cpu"]) if unavailable_reason(e, p, device) is None]
    path = _choice_path(model, candidates)
    if path.exists():
        choice = json.loads(path.read_text())
    else:  # say so: the measurement takes a while
        log.info("auto engine: no measured choice in %s; measuring %s (%d rounds of a batch of %d prompts each, then "
                 "accuracy on %d held-out pairs); later starts read the outcome", path,
                 ", ".join(f"{e}/{p}" for e, p in candidates), PROBE_ROUNDS, PROBE_BATCH, PROBE_PAIRS)
        choice = measure_candidates(model, candidates)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(choice, indent=1))
    log.info("auto engine: %s/%s, by the rule over (the probe: one batch of %d prompts of %d tokens, %d new tokens each, "
             "in-process, no server; task accuracy on %d held-out pairs): %s", *choice["chosen"],
             PROBE_BATCH, PROBE_PROMPT, PROBE_STEPS, PROBE_PAIRS, ", ".join(
                 f"{r['engine']}/{r['precision']} {r['requests_per_s']:.1f} probe requests/s, accuracy {r['accuracy']:.3f}"
                 for r in choice["measured"]))
    return choice["chosen"][0], choice["chosen"][1]


def accuracy_task_missing(model: DecoderModel) -> str | None:
    """Why the held-out arithmetic (:data:`shared.corpus.HELD_OUT_PAIRS`) says nothing about ``model``'s
    accuracy, or None where it does: it is the embedded GPT's task, which no Llama was trained on."""
    if model.config.family == "gpt2":
        return None
    return (f"the rule's accuracy check is the embedded GPT's held-out arithmetic, which a {model.config.family} model "
            "was never trained on, so no reduced precision's accuracy cost can be measured; name --precision bf16 or "
            "int8 to serve one (tests/test_ch05_llama.py bounds their token agreement with fp32)")


def measure_candidates(model: DecoderModel, candidates: list[tuple[str, str]]) -> dict:
    """``{"measured", "chosen", "rule"}``: each candidate's throughput (the median of PROBE_ROUNDS rounds of turns, so
    drift hits all alike) and accuracy, and the rule's pick. A bf16 one computing as fp32 eager is not measured."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (PROBE_PROMPT,), generator=generator).tolist() for _ in range(PROBE_BATCH)]
    engines: dict[tuple[str, str], Engine] = {}
    for engine_name, precision in candidates:
        try:
            engine = BUILDERS[engine_name](model, precision)
        except EngineUnavailable as exc:
            log.info("auto engine: %s/%s cannot run here: %s", engine_name, precision, exc)
            continue
        if precision == "bf16" and not multiplies_in_bf16(engine):
            log.info("auto engine: %s/bf16 is not measured: it computes as fp32 eager here (%s)",
                     engine_name, "; ".join(engine.conversion.notes))
            continue
        engines[engine_name, precision] = engine
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    for _ in range(PROBE_ROUNDS):
        for key, engine in engines.items():
            started = time.perf_counter()
            batched_greedy(engine, prompts, [PROBE_STEPS] * PROBE_BATCH, pad_id=0)
            seconds[key].append(time.perf_counter() - started)
    rows = []
    for (engine_name, precision), engine in engines.items():
        score = evaluate(lambda ids: engine.prefill(ids, None, None, None)[:, None, :], HELD_OUT_PAIRS[:PROBE_PAIRS], device=model.device)
        rows.append({"engine": engine_name, "precision": precision,
                     "requests_per_s": PROBE_BATCH / statistics.median(seconds[engine_name, precision]), "accuracy": score.accuracy})
    return {"measured": rows, "chosen": pick(rows), "rule": RULE}


def pick(rows: list[dict]) -> tuple[str, str]:
    """The rule itself: ``(engine, precision)`` of the fastest of ``rows`` (``{"engine", "precision", "requests_per_s",
    "accuracy"}``, one of them eager/fp32, the baseline) whose accuracy is at least the baseline's minus
    ``ACCURACY_TOLERANCE`` and throughput at least ``MIN_SPEEDUP`` times the baseline's; the baseline if none is."""
    # EXERCISE ch05.2 BEGIN "the default-engine rule: the fastest accurate candidate that clearly beats fp32 eager"
    baseline = next(r for r in rows if (r["engine"], r["precision"]) == ("eager", "fp32"))
    eligible = [
        r for r in rows
        if r["accuracy"] >= baseline["accuracy"] - ACCURACY_TOLERANCE
        and r["requests_per_s"] >= MIN_SPEEDUP * baseline["requests_per_s"]
    ]
    best = max(eligible, key=lambda r: r["requests_per_s"], default=baseline)
    return best["engine"], best["precision"]


def _choice_path(model: DecoderModel, candidates: list[tuple[str, str]]) -> Path:
    # the rule's text is in the key: a choice made under another rule is measured again
    key = f"{weights_fingerprint(model)}-{processor_name(model.device)}-{torch.__version__}-{torch.get_num_threads()}-{candidates}-{RULE}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return ENGINE_CACHE_DIR / f"auto-choice-{digest}.json"
