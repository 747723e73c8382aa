"""Chapter 8's engine step, timed in process: the step-time model chapter 9's simulation runs on.

    python -m benchmarks.studies.scale_out_simulation.measure_steps --out benchmarks/reference/cpu/ch09/step-times.json

Decode steps of 1 to ``max_num_seqs`` rows at two history lengths, and steps that also prefill a
prompt, turned by chapter 8's own step thread (the server's ``build_backend``, its default settings,
one torch thread); the medians and the fitted :class:`~chapters.ch09_scale_out.simulation.StepTimeModel`
go to one JSON file, which ``sweep.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.studies.scale_out_simulation.sweep import _repo_path, environment
from chapters.ch09_scale_out.simulation import DEFAULT_STEP_TIMES, STEP_TIME_FORMULA, StepTimeModel

COMMAND = "python -m benchmarks.studies.scale_out_simulation.measure_steps"

# Decode rows timed: every bucket edge of chapter 8's compiled attention (16, 32, 64) and one past it,
# denser where the step changes fastest; two histories per row count give the cost per position read.
MEASURE_DECODE_ROWS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 40, 48, 56, 64)
MEASURE_HISTORIES: tuple[int, int] = (64, 256)
MEASURE_PREFILL_BESIDE: tuple[int, ...] = (0, 8, 32, 63)  # decode rows beside the prompt (63: the 64th row is the prompt)
MEASURE_PROMPTS: tuple[int, ...] = (16, 32, 64, 128, 256, 448)


def measure(out: Path, rounds: int = 3, timed_steps: int = 6, prefill_repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Time chapter 8's engine step in-process and write the medians and the fitted :class:`StepTimeModel` to ``out``.

    The engine is the server's own (``build_backend`` with chapter 8's default settings, the
    default weights, one torch thread); each step is turned by its step thread's ``step`` and its
    duration is the step clock's (schedule + prepare + model + update), as ``/stats`` reports it.
    Rounds visit every configuration in a new random order, so that a busy moment of a shared
    machine spreads over all of them; each figure is the median over the rounds.
    """
    from shared.devices import choose_device, set_threads
    from shared.weights import load_model
    from chapters.ch08_continuous_batching.scheduler import Sequence as SchedulerSequence
    from chapters.ch08_continuous_batching.server import ContinuousSettings, build_backend

    started = time.perf_counter()
    machine = environment()  # before the measuring loads the machine (its load average)
    settings = ContinuousSettings(weights="default", device="cpu", torch_threads=1)
    set_threads(settings.torch_threads)
    loaded = load_model(settings.weights, settings.preset, choose_device(settings.device), settings.torch_dtype)
    backend = build_backend(settings, loaded)
    engine = backend.step_thread
    scheduler = engine.scheduler
    n_ctx = loaded.config.n_ctx
    rng = random.Random(seed)

    def new_sequence(prompt_tokens: int, max_new_tokens: int) -> SchedulerSequence:
        return SchedulerSequence([rng.randrange(256) for _ in range(prompt_tokens)], max_new_tokens)

    def timed_step() -> tuple[float, float, Any]:
        """One engine step: its CPU time (ms, this thread's), its wall time (ms, the step clock's) and its record.

        The model is fitted to CPU time: on a shared machine a step's wall time also counts the
        moments another process held the core, and the simulation gives every replica a core of its own.
        """
        cpu_started = time.thread_time()
        engine.step()
        cpu_ms = (time.thread_time() - cpu_started) * 1e3
        record = engine.clock.recent[-1]
        return cpu_ms, record.schedule_ms + record.prepare_ms + record.model_ms + record.update_ms, record

    def decoding(rows: int, history: int) -> list[SchedulerSequence]:
        """``rows`` sequences with ``history``-token prompts, all prompts computed, decoding."""
        sequences = [new_sequence(history, n_ctx - history) for _ in range(rows)]
        for sequence in sequences:
            scheduler.add(sequence)
        while any(s.num_computed < len(s.prompt_ids) for s in sequences):
            engine.step()
        return sequences

    def expect(record: Any, rows: int, prompt_tokens: int) -> None:
        if record.decode_rows != rows or record.prefill_tokens != prompt_tokens:
            raise RuntimeError(f"the step computed {record} instead of {rows} decode rows and {prompt_tokens} prompt tokens")

    def clear(sequences: list[SchedulerSequence]) -> None:
        for sequence in sequences:
            scheduler.abort(sequence)

    # (rows, history) or (rows, prompt tokens) -> CPU and wall milliseconds of each timed step
    decode_cpu: dict[tuple[int, int], list[float]] = {}
    decode_wall: dict[tuple[int, int], list[float]] = {}
    context_samples: dict[tuple[int, int], list[float]] = {}
    prefill_cpu: dict[tuple[int, int], list[float]] = {}
    prefill_wall: dict[tuple[int, int], list[float]] = {}
    decode_configs = [(rows, history) for history in MEASURE_HISTORIES for rows in MEASURE_DECODE_ROWS]
    prefill_configs = [(rows, prompt) for rows in MEASURE_PREFILL_BESIDE for prompt in MEASURE_PROMPTS]
    for _ in range(rounds):
        rng.shuffle(decode_configs)
        for rows, history in decode_configs:
            sequences = decoding(rows, history)
            engine.step()  # the first step of every sequence's decoding, untimed
            for _ in range(timed_steps):
                context = sum(len(s.token_ids) for s in sequences)
                cpu_ms, wall_ms, record = timed_step()
                expect(record, rows, 0)
                decode_cpu.setdefault((rows, history), []).append(cpu_ms)
                decode_wall.setdefault((rows, history), []).append(wall_ms)
                context_samples.setdefault((rows, history), []).append(context / rows)
            clear(sequences)
        rng.shuffle(prefill_configs)
        for rows, prompt in prefill_configs:
            prompt = min(prompt, settings.max_num_batched_tokens - rows)
            sequences = decoding(rows, MEASURE_HISTORIES[0]) if rows else []
            for _ in range(prefill_repeats):
                # A prompt of one new token leaves at the end of its prefill step, so the rows stay as they were.
                before = timed_step() if rows else (0.0, 0.0, None)
                scheduler.add(new_sequence(prompt, 1))
                cpu_ms, wall_ms, record = timed_step()
                expect(record, rows, prompt)
                if rows:  # what the prompt added to the decode steps around it
                    after = timed_step()
                    cpu_ms -= (before[0] + after[0]) / 2
                    wall_ms -= (before[1] + after[1]) / 2
                prefill_cpu.setdefault((rows, prompt), []).append(cpu_ms)
                prefill_wall.setdefault((rows, prompt), []).append(wall_ms)
            clear(sequences)

    def median(values: list[float]) -> float:
        return float(np.median(values))

    # Decode: least squares of the per-configuration medians on (1, rows, positions read), both histories together.
    decode_keys = [(rows, history) for history in MEASURE_HISTORIES for rows in MEASURE_DECODE_ROWS]
    design = np.array([[1.0, rows, rows * np.mean(context_samples[(rows, history)])] for rows, history in decode_keys])
    observed = np.array([median(decode_cpu[key]) for key in decode_keys])
    (intercept, per_row, per_context), *_ = np.linalg.lstsq(design, observed, rcond=None)
    decode_residual = observed - design @ np.array([intercept, per_row, per_context])

    def line(points: list[tuple[int, float]]) -> tuple[float, float, float]:
        """Intercept, slope and residual RMS of the least-squares line through ``points``."""
        xs, ys = np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points])
        slope, intercept = np.polyfit(xs, ys, 1)
        return float(intercept), float(slope), float(np.sqrt(np.mean((ys - intercept - slope * xs) ** 2)))

    only = line([(p, median(samples)) for (rows, p), samples in prefill_cpu.items() if rows == 0])
    beside = line([(p, median(samples)) for (rows, p), samples in prefill_cpu.items() if rows > 0])
    model = StepTimeModel(
        step_intercept_ms=round(float(intercept), 4), ms_per_decode_row=round(float(per_row), 5),
        ms_per_context_token=round(float(per_context), 7),
        prefill_intercept_ms=round(beside[0], 4), prefill_ms_per_token=round(beside[1], 6),
        prefill_only_intercept_ms=round(only[0], 4), prefill_only_ms_per_token=round(only[1], 6),
    )
    document = {
        "what": "chapter 8's engine step, timed in-process: decode steps by rows and history, and what a prompt adds to a step",
        "command": f"{COMMAND} --out {_repo_path(out)} --rounds {rounds}",
        "engine": backend.description,
        "settings": {"max_num_seqs": settings.max_num_seqs, "max_num_batched_tokens": settings.max_num_batched_tokens,
                     "kv_policy": settings.kv_policy, "torch_threads": settings.torch_threads, "weights": settings.weights},
        "method": (f"{rounds} rounds, each visiting every configuration in a new random order. Decode: fresh sequences "
                   f"with prompts of the history's length, prefilled, one untimed decode step, then {timed_steps} timed "
                   f"decode steps. Prefill: one prompt of one new token added beside the decode rows ({prefill_repeats} "
                   "times a round), the step's time minus the mean of the pure decode steps before and after it (with "
                   "no decode rows: the step's whole time). cpu_ms: the step thread's CPU time over the whole step, what "
                   "the model is fitted to (a replica with a core of its own); wall_ms: the step clock's schedule + "
                   "prepare + model + update, as chapter 8's /stats reports it, which on a shared machine also counts "
                   "time other processes held the core. Medians over all rounds."),
        "decode": {
            "rows": list(MEASURE_DECODE_ROWS),
            "by_history": {str(history): {
                "cpu_ms": [round(median(decode_cpu[(rows, history)]), 3) for rows in MEASURE_DECODE_ROWS],
                "wall_ms": [round(median(decode_wall[(rows, history)]), 3) for rows in MEASURE_DECODE_ROWS],
                "context_per_row": [round(float(np.mean(context_samples[(rows, history)])), 1) for rows in MEASURE_DECODE_ROWS],
                "samples_per_rows": rounds * timed_steps,
            } for history in MEASURE_HISTORIES},
        },
        "prefill": [{"decode_rows": rows, "prompt_tokens": prompt, "what": "added to the step" if rows else "the whole step",
                     "cpu_ms": round(median(samples), 3), "wall_ms": round(median(prefill_wall[(rows, prompt)]), 3),
                     "samples": len(samples)} for (rows, prompt), samples in sorted(prefill_cpu.items())],
        "model": model.describe(),
        "model_formula": STEP_TIME_FORMULA,
        "fit": {
            "decode": "least squares of the decode cpu_ms medians, both histories, on 1, rows and rows x positions per row",
            "decode_residual_rms_ms": round(float(np.sqrt(np.mean(decode_residual ** 2))), 3),
            "decode_residual_max_ms": round(float(np.max(np.abs(decode_residual))), 3),
            "prefill": "least squares lines of the prefill cpu_ms medians on prompt tokens, with and without decode rows beside",
            "prefill_residual_rms_ms": {"beside_decodes": round(beside[2], 3), "alone": round(only[2], 3)},
        },
        "environment": {**machine, "torch_threads": settings.torch_threads},
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"step times in {document['elapsed_s']} s -> {out}")
    return document


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_STEP_TIMES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    measure(args.out, rounds=args.rounds)


if __name__ == "__main__":
    main()
