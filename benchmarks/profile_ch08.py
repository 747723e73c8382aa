"""Where chapter 8's engine spends a step: ``python -m benchmarks.profile_ch08 [--steps N] [--attention A] [--precision P]``.

64 sequences in a closed loop (a finished one is replaced at once), prompts of the default workload
(16/32/64/128 tokens, 32 new tokens; ``--workload mixed``: 8-256 new tokens), the default model on
one thread, no HTTP: chapter 8's engine step (schedule, one packed forward through the runner,
update) exactly as the server's step thread turns it, with the step clock's split of each phase,
then cProfile over the same number of steps, sorted by internal time. Its output is committed
beside the chapter's figures (``benchmarks/reference/cpu/ch08/``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import time

import torch

from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager
from chapters.ch08_continuous_batching.step_thread import StepThread
from chapters.ch08_continuous_batching.model_runner import ModelRunner, packed_model
from chapters.ch08_continuous_batching.paged_attention import choose_attention
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, Sequence
from chapters.ch08_continuous_batching.server import ContinuousSettings
from shared.weights import load_model

WARM_UP_STEPS = 100
NEW_TOKENS = {"default": (32,), "mixed": (8, 16, 32, 64, 128, 256)}


def profile(steps: int, attention: str, precision: str, workload: str, kv_cache: str = "auto") -> str:
    """The step split and the cProfile report of ``steps`` engine steps, after a warm-up."""
    torch.set_num_threads(1)
    loaded = load_model("default")
    settings = ContinuousSettings()
    step_engine = build_eager(loaded.model, precision)
    model = packed_model(step_engine)
    kv_dtype = kv_cache_dtype(kv_cache, step_engine.precision, step_engine.dtype)
    pool = KVMemoryPool(loaded.config, 512 * 64 * 2, block_tokens=settings.block_tokens, dtype=kv_dtype)
    store = PagedKVStore(pool)
    backend = choose_attention(attention, store, model, settings.max_num_seqs)
    scheduler = ContinuousScheduler(store, settings.scheduler_config())
    engine = StepThread(ModelRunner(model, store, backend), scheduler)
    rng = random.Random(0)

    def new_sequence() -> Sequence:
        prompt = [rng.randrange(256) for _ in range(rng.choice((16, 32, 64, 128)))]
        return Sequence(prompt, rng.choice(NEW_TOKENS[workload]))

    def turn(n_steps: int) -> int:
        """Run ``n_steps``; every sequence that finishes is replaced at once. Returns how many finished."""
        finished = 0
        for _ in range(n_steps):
            before = scheduler.stats.finished
            engine.step()
            done = scheduler.stats.finished - before
            finished += done
            for _ in range(done):
                scheduler.add(new_sequence())
        return finished

    for _ in range(settings.max_num_seqs):
        scheduler.add(new_sequence())
    turn(WARM_UP_STEPS)
    engine.clock.recent.clear()
    started = time.perf_counter()
    finished = turn(steps)
    elapsed = time.perf_counter() - started
    records = list(engine.clock.recent)[-steps:]
    phases = {phase: statistics.median(getattr(r, f"{phase}_ms") for r in records) for phase in engine.clock.PHASES}
    step_ms = sum(phases.values())
    split = ", ".join(f"{phase} {ms:.2f} ms ({ms / step_ms:.0%})" for phase, ms in phases.items())
    head = (
        f"attention {backend.name}, engine {step_engine.label}, KV cache {str(kv_dtype).removeprefix('torch.')}, workload {workload}, {settings.max_num_seqs} sequences\n"
        f"{finished} requests in {elapsed:.2f} s = {finished / elapsed:.1f} req/s "
        f"({sum(r.tokens for r in records) / elapsed:.0f} tokens computed/s) without a profiler\n"
        f"median step {step_ms:.2f} ms: {split}; running {statistics.median(r.running for r in records):.0f}, "
        f"tokens per step {statistics.median(r.tokens for r in records):.0f}\n"
        f"schedule + prepare + update = {(step_ms - phases['model']) / step_ms:.1%} of the median step\n"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    turn(steps)
    profiler.disable()
    report = io.StringIO()
    pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(25)
    return head + report.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_ch08", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--attention", default="auto", choices=("auto", "gather", "flex"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--workload", default="default", choices=sorted(NEW_TOKENS))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    args = parser.parse_args(argv)
    print(profile(args.steps, args.attention, args.precision, args.workload, args.kv_cache_dtype))


if __name__ == "__main__":
    main()
