"""How often chapter 8's attention rule changes its mind between starts: ``python -m benchmarks.studies.startup_rules.startup_rules``.

Builds what a server builds at its defaults (chapter 5's engine by its own cached rule, chapter 4's
pool for ``max_num_seqs`` sequences, the paged store), then runs the attention rule's probe
(:func:`~chapters.ch08_continuous_batching.fast.attention_choice.measure_decode_steps`, every candidate,
``PROBE_ROUNDS`` rounds in turns) ``--starts`` times in this one process, as that many starts would,
the compilations excepted (the first start pays them; the cache makes later starts skip them too).
Each start's rounds are judged by two rules, on the same times:

``rule``       the chapter's rule (:data:`~chapters.ch08_continuous_batching.fast.attention_choice.RULE`):
               two candidates compared round by round (the median of their same-round ratios), the
               simpler one kept unless the other beats it by the margin
``raw median`` the rule it replaced: each candidate's median time, the fastest served if it beats
               gather by the same margin
``round mean`` a rule tried on the way: each time over its round's geometric mean (all candidates),
               the simplest whose median is within the margin of the smallest

Run it on a loaded machine to see the noisy case; the load average at each start is recorded.

    python -m benchmarks.studies.startup_rules.startup_rules --starts 8 \\
        --out benchmarks/reference/cpu/ch08/startup-rules/starts.json
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_description
from benchmarks.harness.results import print_and_save
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch04_memory_pool.server import plan_pool
from chapters.ch05_inference_engine.engine import multiplies_in_bf16
from chapters.ch05_inference_engine.server import engine_for
from chapters.ch08_continuous_batching.fast import attention_choice
from chapters.ch08_continuous_batching.fast.attention_choice import BACKENDS, MARGIN, PREFERENCE, build_attention, measure_decode_steps
from chapters.ch08_continuous_batching.model_runner import packed_model
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.server import ContinuousSettings
from chapters.ch08_continuous_batching.fast.startup_cache import pick_within_margin, quiet_unactionable_warnings
from shared.devices import set_threads
from shared.weights import load_model


def raw_median_choice(samples: dict[str, list[float]]) -> str:
    """The replaced rule: the fastest median if it beats gather's by the margin, else gather."""
    medians = {name: statistics.median(times) for name, times in samples.items()}
    best = min(medians, key=medians.get)
    return best if medians[best] * (1 + MARGIN) <= medians["gather"] else "gather"


def round_mean_choice(samples: dict[str, list[float]]) -> str:
    """The rule tried on the way: times over their round's geometric mean, the simplest within the margin of the best median."""
    ratios = {name: [] for name in samples}
    for times in zip(*samples.values()):
        mean = math.exp(statistics.fmean(math.log(t) for t in times))
        for name, t in zip(samples, times):
            ratios[name].append(t / mean)
    medians = {name: statistics.median(values) for name, values in ratios.items()}
    close = [name for name, median in medians.items() if median <= min(medians.values()) * (1 + MARGIN)]
    return min(close, key=lambda name: PREFERENCE.index(name))


def server_parts(torch_threads: int):
    """The model and the paged store a chapter 8 server builds at its defaults."""
    settings = ContinuousSettings(torch_threads=torch_threads)
    set_threads(settings.torch_threads)
    quiet_unactionable_warnings()
    loaded = load_model(settings.weights, settings.preset, torch.device("cpu"), settings.torch_dtype)
    engine = engine_for(settings, loaded)
    kv_dtype = kv_cache_dtype(settings.kv_cache_dtype, multiplies_in_bf16(engine), engine.dtype)
    plan = plan_pool(settings, settings.max_num_seqs, loaded.config, kv_dtype, engine.device)
    pool = KVMemoryPool(loaded.config, plan.capacity_tokens, block_tokens=settings.block_tokens, device=engine.device, dtype=kv_dtype)
    return settings, engine, packed_model(engine), PagedKVStore(pool)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=0, help="as the server's flag (0: torch's default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    settings, engine, model, store = server_parts(args.torch_threads)
    candidates = {}
    for name in BACKENDS:
        try:
            candidates[name] = build_attention(name, store)
        except ValueError as error:
            print(f"left out: {error}", file=sys.stderr)
    starts = []
    for index in range(args.starts):
        load, started = os.getloadavg()[0], time.perf_counter()
        samples = measure_decode_steps(model, store, candidates, settings.max_num_seqs, leave_out_failing=True)
        outcome = pick_within_margin(samples, PREFERENCE, MARGIN)
        starts.append({"start": index, "load_average_1min": round(load, 2), "seconds": round(time.perf_counter() - started, 1),
                       "rule": outcome["chosen"], "raw_median": raw_median_choice(samples), "round_mean": round_mean_choice(samples),
                       "median_ms": {n: round(t, 2) for n, t in outcome["median_ms"].items()},
                       "ratio_to_gather": {n: round(r, 3) for n, r in outcome["ratio_to_first"].items()},
                       "rounds_ms": {n: [round(t, 2) for t in times] for n, times in outcome["rounds_ms"].items()}})
        print(f"start {index}: rule {starts[-1]['rule']}, raw median {starts[-1]['raw_median']}, round mean {starts[-1]['round_mean']}, "
              f"load {load:.1f}, "
              + ", ".join(f"{n} {t:.1f} ms" for n, t in outcome["median_ms"].items()), file=sys.stderr)
    document = {
        "study": "startup_rules", "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "benchmarks.studies.startup_rules.startup_rules", *(argv or sys.argv[1:])]),
        "cpu": cpu_description(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "engine": engine.label, "kv_cache_dtype": str(store.pool.storage.dtype).removeprefix("torch."),
        "rows": settings.max_num_seqs, "block_tokens": store.block_tokens, "rounds": attention_choice.PROBE_ROUNDS,
        "margin": MARGIN, "preference": list(PREFERENCE),
        "choices": {rule: dict(Counter(s[rule] for s in starts)) for rule in ("rule", "raw_median", "round_mean")},
        "starts": starts,
    }
    print_and_save(document, args.out)
    if args.out:
        args.out.with_suffix(".txt").write_text(summary(document) + "\n")


def summary(document: dict) -> str:
    """The study's answer as text: one line per start, then how often each rule chose each backend."""
    names = list(document["starts"][0]["median_ms"]) if document["starts"] else []
    lines = [f"{document['cpu']}, torch {document['torch']}, {document['torch_threads']} threads, engine {document['engine']}, "
             f"KV {document['kv_cache_dtype']}, {document['rows']} rows, blocks of {document['block_tokens']}, "
             f"{document['rounds']} rounds, margin {document['margin']:.0%}",
             "",
             f"{'start':>5} {'load':>5} {'seconds':>7}  " + "  ".join(f"{n + ' ms':>10} {'ratio':>5}" for n in names)
             + f"  {'rule':>7} {'raw median':>10} {'round mean':>10}"]
    for s in document["starts"]:
        lines.append(f"{s['start']:>5} {s['load_average_1min']:>5.1f} {s['seconds']:>7.1f}  "
                     + "  ".join(f"{s['median_ms'][n]:>10.1f} {s['ratio_to_gather'][n]:>5.2f}" for n in names)
                     + f"  {s['rule']:>7} {s['raw_median']:>10} {s['round_mean']:>10}")
    lines += ["", "choices over the starts: " + "; ".join(f"{rule.replace('_', ' ')}: " + ", ".join(f"{n} {c}" for n, c in counts.items())
                                                       for rule, counts in document["choices"].items()),
              "ms: each candidate's median step over the start's rounds; ratio: the median of its same-round ratios to gather",
              f"command: {document['command']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
