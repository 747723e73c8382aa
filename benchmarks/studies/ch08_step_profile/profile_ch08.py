"""Where chapter 8's engine spends a step: ``python -m benchmarks.studies.ch08_step_profile.profile_ch08 [--steps N] [--attention A] [--precision P]``.

64 sequences in a closed loop (a finished one is replaced at once), prompts of the default workload
(16/32/64/128 tokens, 32 new tokens; ``--workload mixed``: 8-256 new tokens), the default model on
one thread, no HTTP: chapter 8's engine step (schedule, one packed forward through the runner,
update) exactly as the server's step thread turns it, with the step clock's split of each phase,
then cProfile over the same number of steps, sorted by internal time. Its output is committed
beside the chapter's figures (``benchmarks/reference/cpu/ch08/``). ``--temperature T`` samples every
sequence (each with its own seed) instead of decoding greedily.

``--sampling-rounds N --out FILE`` measures what sampling costs instead: N rounds, each running the
same loop greedy and at ``--temperature`` (default 1) one after the other, in alternating order,
without a profiler; the JSON keeps every round's requests per second and median update phase:

    python -m benchmarks.studies.ch08_step_profile.profile_ch08 --sampling-rounds 5 --out benchmarks/reference/cpu/ch08/sampling.json

``--prefix-caching-rounds N`` does the same for prefix caching on against off, where nothing repeats:

    python -m benchmarks.studies.ch08_step_profile.profile_ch08 --prefix-caching-rounds 6 --attention flex --workload default \
        > benchmarks/reference/cpu/ch08/prefix-caching/in-process-default.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_description
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import build_eager, multiplies_in_bf16
from chapters.ch08_continuous_batching.model_runner import ModelRunner, packed_model
from chapters.ch08_continuous_batching.fast.attention_choice import choose_attention
from benchmarks.studies.real_model_peers.compiled_blocks import compile_blocks
from chapters.ch08_continuous_batching.paged_cache import PagedKVStore, kv_cache_dtype
from chapters.ch08_continuous_batching.sampling import GREEDY, SamplingParams
from chapters.ch08_continuous_batching.scheduler import ContinuousScheduler, Sequence
from chapters.ch08_continuous_batching.server import ContinuousSettings
from chapters.ch08_continuous_batching.step_thread import StepThread
from shared.weights import load_model

WARM_UP_STEPS = 100
NEW_TOKENS = {"default": (32,), "mixed": (8, 16, 32, 64, 128, 256)}


@dataclass
class ClosedLoop:
    """Chapter 8's engine with ``max_num_seqs`` sequences always running; :meth:`turn` steps it."""

    engine: StepThread
    new_sequence: Callable[[], Sequence]
    label: str

    def turn(self, n_steps: int) -> int:
        """Run ``n_steps``; every sequence that finishes is replaced at once. Returns how many finished."""
        scheduler = self.engine.scheduler
        finished = 0
        for _ in range(n_steps):
            before = scheduler.stats.finished
            self.engine.step()
            done = scheduler.stats.finished - before
            finished += done
            for _ in range(done):
                scheduler.add(self.new_sequence())
        return finished

    def timed(self, steps: int) -> tuple[int, float, list]:
        """(finished, seconds, step records) of ``steps`` steps, no profiler."""
        self.engine.clock.recent.clear()
        started = time.perf_counter()
        finished = self.turn(steps)
        return finished, time.perf_counter() - started, list(self.engine.clock.recent)[-steps:]


def closed_loop(attention: str, precision: str, workload: str, kv_cache: str = "auto", temperature: float = 0.0,
                prefix_caching: str | None = None, block_tokens: int | None = None, weights: str = "default",
                blocks: str = "served") -> ClosedLoop:
    """The loop, warmed up (``WARM_UP_STEPS``); every run of it draws the same prompts. ``prefix_caching``:
    on or off; ``block_tokens``: the pool's block (None for either: the server's default); ``weights``: as
    the servers' ``--weights``; ``blocks``: ``served`` (chapter 5's engine as it builds them: fused C passes where they
    apply), ``eager`` (every block's own PyTorch halves) or ``compiled`` (the real-model study's ``compiled_blocks``)."""
    torch.set_num_threads(1)
    loaded = load_model(weights)
    overrides = {"prefix_caching": prefix_caching, "block_tokens": block_tokens}
    settings = ContinuousSettings(**{name: value for name, value in overrides.items() if value is not None})
    step_engine = build_eager(loaded.model, precision)
    model = packed_model(step_engine)
    if blocks in ("eager", "compiled"):
        for block in model.blocks:  # the class's own halves again, where chapter 5 fused them
            block.__dict__.pop("attention_inputs", None), block.__dict__.pop("after_attention", None)
    if blocks == "compiled":
        compile_blocks(model, warm_up_tokens=(1, 2, settings.max_num_seqs, settings.max_num_batched_tokens))
    kv_dtype = kv_cache_dtype(kv_cache, multiplies_in_bf16(step_engine), step_engine.dtype)
    pool = KVMemoryPool(loaded.config, 512 * 64 * 2, block_tokens=settings.block_tokens, dtype=kv_dtype)
    store = PagedKVStore(pool, prefix_caching=settings.prefix_caching == "on")  # as the server runs by default
    backend = choose_attention(attention, store, model, settings.max_num_seqs)
    scheduler = ContinuousScheduler(store, settings.scheduler_config())
    engine = StepThread(ModelRunner(model, store, backend), scheduler)
    rng = random.Random(0)
    seeds = iter(range(10**9))

    def new_sequence() -> Sequence:
        prompt = [rng.randrange(min(256, loaded.config.vocab_size)) for _ in range(rng.choice((16, 32, 64, 128)))]
        sampling = SamplingParams(temperature=temperature, seed=next(seeds)) if temperature else GREEDY
        return Sequence(prompt, rng.choice(NEW_TOKENS[workload]), sampling=sampling)

    sampling = f"temperature {temperature:g}" if temperature else "greedy"
    if blocks == "served":
        blocks = ("fused" if getattr(step_engine.module, "fusion_missing", "") is None else "eager") + " (as served)"
    engine_label = f"{step_engine.label}, {blocks} blocks"
    label = (f"{loaded.source}: attention {backend.name}, engine {engine_label}, KV cache {str(kv_dtype).removeprefix('torch.')}, "
             f"workload {workload}, blocks of {settings.block_tokens}, {settings.max_num_seqs} sequences, {sampling}")
    loop = ClosedLoop(engine, new_sequence, label)
    for _ in range(settings.max_num_seqs):
        scheduler.add(new_sequence())
    loop.turn(WARM_UP_STEPS)
    return loop


def profile(steps: int, attention: str, precision: str, workload: str, kv_cache: str = "auto", temperature: float = 0.0,
            block_tokens: int | None = None, weights: str = "default", profiler: str = "cprofile") -> str:
    """The step split and the report of ``steps`` engine steps, after a warm-up: cProfile's by internal time, or
    (``profiler="torch"``) PyTorch's operator totals by self CPU time, as vLLM's profiler reports them."""
    loop = closed_loop(attention, precision, workload, kv_cache, temperature, block_tokens=block_tokens, weights=weights)
    finished, elapsed, records = loop.timed(steps)
    phases = {phase: statistics.median(getattr(r, f"{phase}_ms") for r in records) for phase in loop.engine.clock.PHASES}
    step_ms = sum(phases.values())
    split = ", ".join(f"{phase} {ms:.2f} ms ({ms / step_ms:.0%})" for phase, ms in phases.items())
    head = (
        f"{loop.label}\n"
        f"{finished} requests in {elapsed:.2f} s = {finished / elapsed:.1f} req/s "
        f"({sum(r.tokens for r in records) / elapsed:.0f} tokens computed/s) without a profiler\n"
        f"median step {step_ms:.2f} ms: {split}; running {statistics.median(r.running for r in records):.0f}, "
        f"tokens per step {statistics.median(r.tokens for r in records):.0f}\n"
        f"schedule + prepare + update = {(step_ms - phases['model']) / step_ms:.1%} of the median step\n"
        f"CPU: {cpu_description()}\n"
    )
    if profiler == "torch":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as operators:
            loop.turn(steps)
        return head + operators.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    python = cProfile.Profile()
    python.enable()
    loop.turn(steps)
    python.disable()
    report = io.StringIO()
    pstats.Stats(python, stream=report).sort_stats("tottime").print_stats(25)
    return head + report.getvalue()


def prefix_caching_rounds(rounds: int, steps: int, attention: str, precision: str, workload: str) -> str:
    """Prefix caching on against off where no prompt repeats (its cost alone), in alternating order, no profiler."""
    loops = {flag: closed_loop(attention, precision, workload, prefix_caching=flag) for flag in ("on", "off")}
    lines = [f"prefix caching on against off, {loops['on'].label.rsplit(', ', 1)[0]}, {steps} steps a run:"]
    ratios = []
    for index in range(rounds):
        order = ["on", "off"] if index % 2 == 0 else ["off", "on"]
        rate = {}
        for flag in order:
            finished, elapsed, _ = loops[flag].timed(steps)
            rate[flag] = finished / elapsed
        ratios.append(rate["on"] / rate["off"])
        lines.append(f"round {index + 1} ({order[0]} first): on {rate['on']:.1f} req/s, off {rate['off']:.1f} req/s, on/off {ratios[-1]:.3f}")
    lines.append(f"median on/off {statistics.median(ratios):.3f}; the cache after it: {loops['on'].engine.scheduler.describe()['prefix_cache']}")
    return "\n".join(lines)


def sampling_rounds(rounds: int, steps: int, attention: str, precision: str, workload: str, temperature: float) -> dict:
    """Greedy against sampling at ``temperature``, the same loop, one after the other in alternating order."""
    loops = {"greedy": closed_loop(attention, precision, workload), "sampled": closed_loop(attention, precision, workload, temperature=temperature)}
    measured: list[dict] = []
    for index in range(rounds):
        order = ["greedy", "sampled"] if index % 2 == 0 else ["sampled", "greedy"]
        row: dict = {"order": order}
        for name in order:
            finished, elapsed, records = loops[name].timed(steps)
            row[name] = {"requests_per_s": finished / elapsed, "median_update_ms": statistics.median(r.update_ms for r in records),
                         "median_step_ms": statistics.median(r.schedule_ms + r.prepare_ms + r.model_ms + r.update_ms for r in records)}
        measured.append(row)
    ratios = [r["sampled"]["requests_per_s"] / r["greedy"]["requests_per_s"] for r in measured]
    return {"command": f"python -m benchmarks.studies.ch08_step_profile.profile_ch08 --sampling-rounds {rounds} --steps {steps} --attention {attention} "
                       f"--precision {precision} --workload {workload} --temperature {temperature:g}",
            "greedy": loops["greedy"].label, "sampled": loops["sampled"].label, "steps": steps, "rounds": measured,
            "median_ratio": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.ch08_step_profile.profile_ch08", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--attention", default="auto", choices=("auto", "gather", "flex", "kernel"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--workload", default="default", choices=sorted(NEW_TOKENS))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--block-tokens", type=int, default=None, help="the pool's block (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy; 1 with --sampling-rounds)")
    parser.add_argument("--sampling-rounds", type=int, default=0, help="measure greedy against sampling, this many interleaved rounds")
    parser.add_argument("--out", type=Path, default=None, help="with --sampling-rounds: write the JSON here")
    parser.add_argument("--prefix-caching-rounds", type=int, default=0, help="measure prefix caching on against off, this many rounds")
    parser.add_argument("--weights", default="default", help="the model, as the servers' --weights (smollm2: the real model)")
    parser.add_argument("--profiler", default="cprofile", choices=("cprofile", "torch"),
                        help="torch: PyTorch's operator totals (as vLLM's profiler reports them) instead of cProfile's")
    args = parser.parse_args(argv)
    if args.prefix_caching_rounds:
        print(prefix_caching_rounds(args.prefix_caching_rounds, args.steps, args.attention, args.precision, args.workload))
        return
    if args.sampling_rounds:
        document = sampling_rounds(args.sampling_rounds, args.steps, args.attention, args.precision, args.workload,
                                   1.0 if args.temperature is None else args.temperature)
        text = json.dumps(document, indent=2)
        if args.out is not None:
            args.out.write_text(text + "\n")
        print(text)
        return
    print(profile(args.steps, args.attention, args.precision, args.workload, args.kv_cache_dtype, args.temperature or 0.0,
                  args.block_tokens, args.weights, args.profiler))


if __name__ == "__main__":
    main()
