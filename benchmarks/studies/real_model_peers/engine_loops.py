"""Chapter 8's engine against vLLM's, each in its own loop with no HTTP: which server's arithmetic is faster, and where each
step goes (PyTorch's profiler over both, the operator totals vLLM's own profiler reports).

Both loops keep 64 sequences running and replace each one that finishes at once (``profile_ch08``'s closed loop; vLLM's
``LLMEngine.add_request`` and ``step``), from the same seeded requests: the ``default`` workload's random ids, prompts of
16, 32, 64 or 128 tokens, 32 new tokens, greedy (vLLM told to ignore the end of sequence, as chapter 8's completions do).
Each loop is warmed up (:data:`WARM_UP_FINISHED` requests), then timed over ``--seconds``; chapter 8 at its served
settings for the real model (the start-up rule's attention; chapter 5's fused blocks; ``ch08-eager-blocks``: each block's own
PyTorch halves instead; ``ch08-compiled``: those compiled, :mod:`.compiled_blocks`), vLLM at
its CPU defaults; both at ``--dtype`` (bf16: chapter 8's ``--precision bf16``, vLLM's bfloat16; fp32 where the CPU has
no bf16 arithmetic and emulates it). One process per run, pinned to the server's core (``VLLM_CPU_OMP_THREADS_BIND``
for vLLM, one torch thread for chapter 8)::

    python -m benchmarks.studies.real_model_peers.engine_loops compare --rounds 3 --seconds 30 \\
        --out benchmarks/reference/cpu/real-model-peers/engine-loops.json
    python -m benchmarks.studies.real_model_peers.engine_loops run ch08 --profile benchmarks/studies/real_model_peers/profile-ch08.txt
    python -m benchmarks.studies.real_model_peers.engine_loops run vllm --profile benchmarks/studies/real_model_peers/profile-vllm.txt

``run`` prints one JSON line; ``compare`` runs the engines in turns (reversed every other round) and keeps every round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
HF_DIR = REPO_ROOT / ".cache" / "real-model-peers" / "smollm2-hf"
RUNNING = 64
PROMPT_LENGTHS = (16, 32, 64, 128)
NEW_TOKENS = 32
WARM_UP_FINISHED = 128
SERVER_CORES = [0]
ENGINES = ("ch08", "ch08-eager-blocks", "ch08-compiled", "vllm")
DTYPES = {"bf16": ("bf16", "bfloat16"), "fp32": ("fp32", "float32")}  # --dtype: (chapter 8's --precision, vLLM's --dtype)


def requests(seed: int = 0, vocab: int = 256) -> Iterator[list[int]]:
    """The loops' prompts, endless and the same for both engines."""
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(vocab) for _ in range(rng.choice(PROMPT_LENGTHS))]


def closed_loop(step: Callable[[], tuple[list[Hashable], int]], add: Callable[[list[int]], Hashable], seconds: float,
                profile: Path | None, table: Callable[[object], str]) -> dict:
    """Keep RUNNING requests in flight (``add`` one and get its key; ``step`` returns the keys of those that finished and
    how many tokens it generated), warm up, then time ``seconds``.

    Every request asks for the same NEW_TOKENS, so requests that start together finish together, in cohorts: a window's
    count of finished requests moves in steps of a cohort whatever the engine's speed, and its count of generated tokens
    with where in a cohort's life (prompts first, then one token a step) the window ends. A request's life does not:
    with RUNNING always in flight, Little's law gives the loop's rate as RUNNING over the mean life of the requests that
    finished in the window (``requests_per_s``). ``finished_per_s`` keeps the window's plain count."""
    prompts = requests()
    in_flight: dict[Hashable, tuple[float, int]] = {}  # key: (when added, prompt length)

    def admit() -> None:
        prompt = next(prompts)
        in_flight[add(prompt)] = (time.perf_counter(), len(prompt))

    for _ in range(RUNNING):
        admit()

    def turn_until(stop: Callable[[int, float], bool]) -> dict:
        generated = tokens = 0
        lives: list[float] = []
        started = time.perf_counter()
        while not stop(len(lives), time.perf_counter() - started):
            done, new = step()
            now, generated = time.perf_counter(), generated + new
            for key in done:
                added, prompt_length = in_flight.pop(key)
                lives.append(now - added)
                tokens += prompt_length + NEW_TOKENS
                admit()
        elapsed = time.perf_counter() - started
        if not lives:
            raise RuntimeError(f"no request finished in {elapsed:.0f} s: lengthen --seconds")
        mean_life = statistics.fmean(lives)
        return {"finished": len(lives), "seconds": round(elapsed, 3), "requests_per_s": round(RUNNING / mean_life, 3),
                "mean_life_s": round(mean_life, 3), "finished_per_s": round(len(lives) / elapsed, 3),
                "tokens_per_s": round(tokens / elapsed, 1), "generated_per_s": round(generated / elapsed, 1)}

    turn_until(lambda finished, _: finished >= WARM_UP_FINISHED)
    record = turn_until(lambda _, elapsed: elapsed >= seconds)
    if profile is not None:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as operators:
            profiled = turn_until(lambda _, elapsed: elapsed >= seconds)
        profile.write_text(f"{json.dumps(record)}\n(profiled: {json.dumps(profiled)})\n" + table(operators) + "\n")
    return record


def _table(operators) -> str:
    return operators.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def run_ch08(seconds: float, profile: Path | None, dtype: str, engine: str) -> dict:
    import torch

    from benchmarks.studies.ch08_step_profile.profile_ch08 import closed_loop as ch08_loop
    from chapters.ch08_continuous_batching.sampling import GREEDY
    from chapters.ch08_continuous_batching.scheduler import Sequence
    from chapters.ch08_continuous_batching.sequence import Status

    blocks = {"ch08": "served", "ch08-eager-blocks": "eager", "ch08-compiled": "compiled"}[engine]
    loop = ch08_loop("auto", DTYPES[dtype][0], "default", weights="smollm2", blocks=blocks)  # warmed up
    scheduler = loop.engine.scheduler
    while scheduler.running or scheduler.waiting:  # drained, so both loops start from RUNNING of the same requests
        loop.engine.step()

    in_flight: set[Sequence] = set()

    def add(prompt: list[int]) -> Sequence:
        sequence = Sequence(prompt, NEW_TOKENS, sampling=GREEDY)
        scheduler.add(sequence)
        in_flight.add(sequence)
        return sequence

    def step() -> tuple[list[Sequence], int]:
        generated = scheduler.stats.tokens_generated
        loop.engine.step()
        finished = [sequence for sequence in in_flight if sequence.status is Status.FINISHED]
        in_flight.difference_update(finished)
        return finished, scheduler.stats.tokens_generated - generated

    record = closed_loop(step, add, seconds, profile, _table)
    return {"engine": engine, "label": loop.label, "torch": torch.__version__, **record}


def run_vllm(seconds: float, profile: Path | None, dtype: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, for the profiler
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(HF_DIR), dtype=DTYPES[dtype][1], max_model_len=512, max_num_seqs=RUNNING, seed=0)
    engine, params, ids = llm.llm_engine, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), iter(range(10**9))

    tokens_so_far: dict[str, int] = {}  # each running request's output length at its last step (outputs are cumulative)

    def step() -> tuple[list[str], int]:
        finished, generated = [], 0
        for output in engine.step():
            count = len(output.outputs[0].token_ids)
            generated += count - tokens_so_far.get(output.request_id, 0)
            tokens_so_far[output.request_id] = count
            if output.finished:
                finished.append(output.request_id)
                del tokens_so_far[output.request_id]
        return finished, generated

    def add(prompt: list[int]) -> str:
        request_id = str(next(ids))
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        return request_id

    record = closed_loop(step, add, seconds, profile, _table)
    return {"engine": "vllm", "label": f"vLLM {vllm.__version__} CPU, {DTYPES[dtype][1]}, max_num_seqs {RUNNING}, max_model_len 512",
            **record}


def _command(engine: str, seconds: float, dtype: str) -> list[str]:
    python = str(VLLM_PYTHON) if engine == "vllm" else sys.executable
    return ["taskset", "-c", ",".join(map(str, SERVER_CORES)), python, "-m", "benchmarks.studies.real_model_peers.engine_loops",
            "run", engine, "--seconds", str(seconds), "--dtype", dtype]


def _environment(engine: str) -> dict[str, str]:
    if engine == "vllm":
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, SERVER_CORES)), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return {"OMP_NUM_THREADS": "1"}


def compare(rounds: int, seconds: float, dtype: str, engines: tuple[str, ...], command: str) -> dict:
    from benchmarks.harness.environment import cpu_description  # the project's venv: this module also runs in vLLM's

    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    for index in range(rounds):
        for engine in engines if index % 2 == 0 else engines[::-1]:
            done = subprocess.run(_command(engine, seconds, dtype), cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, **_environment(engine)}, check=True)
            runs[engine].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {index + 1}/{rounds} {engine}: {runs[engine][-1]['requests_per_s']:.2f} req/s", file=sys.stderr)
    return summarized({"kind": "engine-loops", "command": command, "cpu": cpu_description(), "dtype": dtype, "running": RUNNING,
                       "new_tokens": NEW_TOKENS, "prompt_lengths": list(PROMPT_LENGTHS), "seconds": seconds,
                       "server_cores": SERVER_CORES, "environments": {engine: _environment(engine) for engine in engines},
                       "runs": runs})


def summarized(document: dict) -> dict:
    """``document`` with the medians of its rounds' ``requests_per_s`` and the ratios to vLLM, overall and round by round."""
    runs = document["runs"]
    medians = {engine: statistics.median(r["requests_per_s"] for r in rows) for engine, rows in runs.items()}
    chapter8 = [engine for engine in runs if engine != "vllm"]
    return {**document, "median_requests_per_s": medians, "requests_counted": "Little's law",
            "over_vllm": {engine: round(medians[engine] / medians["vllm"], 3) for engine in chapter8},
            "over_vllm_each_round": {engine: [round(a["requests_per_s"] / b["requests_per_s"], 3)
                                              for a, b in zip(runs[engine], runs["vllm"])] for engine in chapter8}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.real_model_peers.engine_loops", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one engine's loop, in this interpreter")
    run.add_argument("engine", choices=ENGINES)
    run.add_argument("--seconds", type=float, default=30.0)
    run.add_argument("--profile", type=Path, default=None, help="then profile as long again and write the operator table here")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    both = commands.add_parser("compare", help="both engines in turns, each in its own pinned process")
    both.add_argument("--rounds", type=int, default=3)
    both.add_argument("--seconds", type=float, default=30.0)
    both.add_argument("--out", type=Path, required=True)
    both.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    both.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    args = parser.parse_args(argv)
    if args.command == "run":
        result = (run_vllm(args.seconds, args.profile, args.dtype) if args.engine == "vllm"
                  else run_ch08(args.seconds, args.profile, args.dtype, args.engine))
        print(json.dumps(result))
        return
    engines = tuple(engine for engine in ENGINES if engine in args.engines)
    if "vllm" not in engines:
        parser.error("compare measures chapter 8 against vLLM: --engines includes vllm")
    document = compare(args.rounds, args.seconds, args.dtype, engines,
                       f"python -m benchmarks.studies.real_model_peers.engine_loops compare --rounds {args.rounds} "
                       f"--seconds {args.seconds:g} --dtype {args.dtype} --engines {' '.join(engines)} --out {args.out}")
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document["median_requests_per_s"]), document["over_vllm"])


if __name__ == "__main__":
    main()
