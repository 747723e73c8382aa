"""Where chapter 8's engine spends a step: ``python -m benchmarks.profile_ch08 [STEPS]``.

64 sequences in a closed loop (a finished one is replaced at once), prompts of the default workload
(16/32/64/128 tokens, 32 new tokens), the default model on one thread, no HTTP: cProfile over
STEPS steps of chapter 3's step loop with chapter 8's scheduler, sorted by cumulative time. Its
output is committed beside the chapter's figures (``benchmarks/reference/cpu/ch08/``).
"""
import cProfile
import io
import pstats
import random
import sys
import time

import torch

from chapters.ch03_dynamic_batching.step_loop import run_step
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, Sequence
from chapters.ch08_continuous_batching.server import ContinuousSettings
from shared.weights import load_model

WARM_UP_STEPS = 100


def profile(steps: int) -> str:
    """The cProfile report of ``steps`` engine steps, after a warm-up, headed by the requests per second."""
    torch.set_num_threads(1)
    loaded = load_model("default")
    settings = ContinuousSettings()
    store = PagedKVStore(KVMemoryPool(loaded.config, 512 * 64 * 2, block_tokens=settings.block_tokens))
    scheduler = ContinuousScheduler(store, settings.scheduler_config(), loaded.tokenizer.pad_id)
    rng = random.Random(0)

    def new_sequence() -> Sequence:
        return Sequence([rng.randrange(256) for _ in range(rng.choice((16, 32, 64, 128)))], 32)

    def turn(n_steps: int) -> int:
        """Run ``n_steps``; every sequence that finishes is replaced at once. Returns how many finished."""
        finished = 0
        for _ in range(n_steps):
            before = scheduler.stats.finished
            run_step(scheduler, loaded.model)
            done = scheduler.stats.finished - before
            finished += done
            for _ in range(done):
                scheduler.add(new_sequence())
        return finished

    for _ in range(64):
        scheduler.add(new_sequence())
    turn(WARM_UP_STEPS)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    finished = turn(steps)
    profiler.disable()
    elapsed = time.perf_counter() - started
    report = io.StringIO()
    pstats.Stats(profiler, stream=report).sort_stats("cumulative").print_stats(30)
    return f"{finished} requests in {elapsed:.2f} s = {finished / elapsed:.1f} req/s (under cProfile)\n{report.getvalue()}"


if __name__ == "__main__":
    print(profile(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
