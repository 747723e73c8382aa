"""``python -m benchmarks.harness.tradeoffs``: what each engine and precision costs and buys, here.

For every engine x precision that can run on this machine (the others are listed with the reason):

- **task accuracy**: the default model's held-out reversed-sum additions (:func:`shared.corpus.evaluate`);
- **token agreement**: greedy tokens equal to fp32 eager's, position by position, over a fixed set
  of readable prompts (arithmetic and sentences), 32 new tokens each, and how many whole rows match;
- **max |logit diff|**: largest difference from fp32 eager's logits, teacher-forced along fp32
  eager's tokens (so both see the same inputs: prefill and every decode step);
- **latency at batch 1**: median of whole 32-token generations for one workload prompt;
- **throughput at batch 32**: generated tokens per second for 32 workload prompts (the harness's
  16/32/64/128-token mix) generated together, median of runs;
- **conversion cost**: seconds and artifact bytes (from the engine cache or fresh).

Generation goes through chapter 3's step loop with chapter 4's KV pool, the server's path; the
logits are taken through the same loop, teacher-forced. Chapter 5's ``--precision auto`` measures
its candidates at start-up with a smaller probe of the same kind (``engines.measure_candidates``);
this table is the full measurement the lesson discusses.
Every figure printed comes from this run; the JSON records the environment beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from benchmarks.harness.environment import cpu_model, git_state
from benchmarks.harness.workload import DEFAULT_SEED, PromptStream, get_workload
from chapters.ch03_dynamic_batching.batched_generation import StaticBatch, generate_batch
from chapters.ch03_dynamic_batching.step_loop import run_until_done
from chapters.ch04_memory_pool.memory_pool import KVMemoryPool
from chapters.ch05_inference_engine.engine import ENGINES, PRECISIONS, Engine, EngineUnavailable
from chapters.ch05_inference_engine.engines import ACCURACY_TOLERANCE, CANDIDATES, MIN_SPEEDUP, build_engine, pick, unavailable_reason
from shared.corpus import HELD_OUT_PAIRS, evaluate, sentence
from shared.devices import choose_device, set_threads, synchronize
from shared.model import GPT, DynamicKVCache
from shared.paths import REPO_ROOT as PROJECT_ROOT
from shared.tokenizer import PAD_ID, ByteTokenizer
from shared.weights import load_model

RESULTS_DIR = PROJECT_ROOT / "benchmarks" / "results" / "ch05-tradeoffs"
REFERENCE_DIR = PROJECT_ROOT / "benchmarks" / "reference" / "ch05-tradeoffs"
NEW_TOKENS = 32


# ---------------------------------------------------------------------------------------------
# The fixed inputs
# ---------------------------------------------------------------------------------------------


def agreement_prompts(n_arithmetic: int = 8, n_sentences: int = 8) -> list[list[int]]:
    """Readable prompts the model was trained on the kind of: held-out additions and sentence starts."""
    import random

    tokenizer = ByteTokenizer()
    rng = random.Random(5)
    prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in HELD_OUT_PAIRS[:n_arithmetic]]
    for _ in range(n_sentences):
        words = sentence(rng).split()
        prompts.append(tokenizer.encode(" ".join(words[: rng.randint(2, 5)]) + " "))
    return prompts


def workload_prompts(n: int, seed: int = DEFAULT_SEED) -> list[list[int]]:
    """``n`` prompts of the harness's default workload (random bytes, lengths 16/32/64/128)."""
    stream = PromptStream(get_workload("default"), seed, user_index=0)
    return [stream.next_body()["input_ids"] for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# The measurements
# ---------------------------------------------------------------------------------------------


class PoolForEngine:
    """Chapter 4's pool, in the engine's KV dtype, lending one cache per batch and taking it back."""

    def __init__(self, engine: Engine, tokens: int) -> None:
        self.pool = KVMemoryPool(engine.config, tokens, device=engine.device, dtype=engine.dtype)
        self._open: list = []

    def factory(self, batch_size: int, max_len: int):
        cache = self.pool.new_cache(batch_size, max_len)
        self._open.append(cache)
        return cache

    def generate(self, engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        try:
            rows = generate_batch(engine, prompts, [new_tokens] * len(prompts), PAD_ID, self.factory)
        finally:
            while self._open:
                self._open.pop().close()
        return [row.output_ids for row in rows]


class TeacherForced(StaticBatch):
    """Chapter 3's request-level batch, fed ``forced`` tokens instead of its own argmax; keeps every step's logits."""

    def __init__(self, engine: Engine, prompts: list[list[int]], forced: list[list[int]]) -> None:
        steps = len(forced[0])
        super().__init__(engine.config, engine.device, prompts, [steps] * len(prompts), PAD_ID,
                         DynamicKVCache(engine.config.n_layer), prefill="padded")
        self.forced = torch.tensor(forced, device=engine.device)
        self.logits: list[torch.Tensor] = []

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.float().cpu())
        return self.forced[:, self.taken]


@torch.no_grad()
def teacher_forced_logits(engine: Engine, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """Logits (steps, B, V) of ``engine`` fed ``forced`` tokens after the prompts, through the step loop."""
    batch = TeacherForced(engine, prompts, forced)
    run_until_done(batch, engine)
    return torch.stack(batch.logits)


def median_seconds(run, repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


@dataclass
class Row:
    engine: str
    precision: str
    available: bool
    reason: str | None = None
    accuracy: float | None = None
    token_agreement: float | None = None
    rows_identical: str | None = None
    oracle_exact: bool | None = None  # fp32 engines only: greedy tokens == shared.generation.reference_greedy
    max_logit_diff: float | None = None
    latency_b1_ms: float | None = None
    throughput_tok_s: float | None = None
    conversion_s: float | None = None
    conversion_from_cache: bool | None = None
    artifact_mb: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Baseline:
    """fp32 eager's answers, which every other engine is compared with."""

    tokens: list[list[int]]
    logits: torch.Tensor


def measure(
    engine: Engine, baseline: Baseline | None, oracle: list[list[int]], args: argparse.Namespace
) -> tuple[Row, Baseline | None]:
    """One row of the table; the second value is the baseline when this engine is the first (fp32 eager)."""
    row = Row(engine.name, engine.precision, True)
    prompts = agreement_prompts()
    pool = PoolForEngine(engine, tokens=max(args.batch, len(prompts)) * engine.config.n_ctx)
    row.accuracy = evaluate(lambda ids: engine.prefill(ids, None, None, None)[:, None, :], device=engine.device).accuracy
    tokens = pool.generate(engine, prompts, NEW_TOKENS)
    reference = baseline.tokens if baseline else tokens
    same = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r))
    row.token_agreement = same / sum(len(r) for r in reference)
    row.rows_identical = f"{sum(t == r for t, r in zip(tokens, reference))}/{len(reference)}"
    if engine.precision == "fp32":
        row.oracle_exact = tokens == oracle
    logits = teacher_forced_logits(engine, prompts, reference)
    row.max_logit_diff = float((logits - baseline.logits).abs().max()) if baseline else 0.0

    one_prompt = workload_prompts(1)
    pool.generate(engine, one_prompt, NEW_TOKENS)  # warm-up
    row.latency_b1_ms = 1e3 * median_seconds(lambda: pool.generate(engine, one_prompt, NEW_TOKENS), args.latency_runs)
    batch_prompts = workload_prompts(args.batch)
    pool.generate(engine, batch_prompts, NEW_TOKENS)  # warm-up
    seconds = median_seconds(lambda: (pool.generate(engine, batch_prompts, NEW_TOKENS), synchronize(engine.device)), args.throughput_runs)
    row.throughput_tok_s = args.batch * NEW_TOKENS / seconds

    row.conversion_s = engine.conversion.seconds
    row.conversion_from_cache = engine.conversion.from_cache
    if engine.conversion.artifact_bytes is not None:
        row.artifact_mb = engine.conversion.artifact_bytes / 1e6
    row.notes = engine.conversion.notes
    return row, (Baseline(tokens, logits) if baseline is None else None)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    commit, dirty = git_state()
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "packages": {name: _version(name) for name in ("torch", "onnxruntime", "onnx", "onnxscript", "torchao", "torch_tensorrt")},
    }


def run(args: argparse.Namespace) -> dict:
    set_threads(args.torch_threads)
    device = choose_device(args.device)
    loaded = load_model(args.weights, preset=args.preset, device=device)
    model: GPT = loaded.model
    from shared.generation import reference_greedy

    prompts = agreement_prompts()
    oracle = [reference_greedy(model, p, NEW_TOKENS) for p in prompts]
    rows: list[Row] = []
    baseline: Baseline | None = None
    # fp32 eager first: it is the baseline every other row is compared with.
    combos = [(e, p) for e in args.engines for p in args.precisions]
    combos.sort(key=lambda c: (c != ("eager", "fp32"),))
    if ("eager", "fp32") not in combos:
        combos.insert(0, ("eager", "fp32"))
    for engine_name, precision in combos:
        label = f"{engine_name}/{precision}"
        reason = unavailable_reason(engine_name, precision, device)
        if reason:
            rows.append(Row(engine_name, precision, False, reason))
            print(f"[ch05] {label}: unavailable: {reason}", file=sys.stderr, flush=True)
            continue
        print(f"[ch05] {label}: building and measuring ...", file=sys.stderr, flush=True)
        try:
            engine = build_engine(model, engine_name, precision)
        except EngineUnavailable as exc:
            rows.append(Row(engine_name, precision, False, str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 (a conversion that fails here is a finding, not a crash of the table)
            rows.append(Row(engine_name, precision, False, f"failed to build: {type(exc).__name__}: {str(exc)[:300]}"))
            continue
        try:
            row, new_baseline = measure(engine, baseline, oracle, args)
        except Exception as exc:  # noqa: BLE001 (same: one engine failing to run is a row, not a lost table)
            rows.append(Row(engine_name, precision, False, f"failed to run: {type(exc).__name__}: {str(exc)[:300]}"))
            print(f"[ch05] {label}: failed: {exc}", file=sys.stderr, flush=True)
            continue
        baseline = baseline or new_baseline
        rows.append(row)
        print(f"[ch05] {label}: done", file=sys.stderr, flush=True)
        del engine
    return {
        "command": "python -m benchmarks.harness.tradeoffs " + " ".join(sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": loaded.source,
        "config": {"new_tokens": NEW_TOKENS, "batch": args.batch, "latency_runs": args.latency_runs,
                   "throughput_runs": args.throughput_runs, "agreement_prompts": len(prompts),
                   "held_out_pairs": len(HELD_OUT_PAIRS)},
        "environment": environment(device),
        "rows": [asdict(r) for r in rows],
    }


def _fmt(value, pattern: str) -> str:
    return "" if value is None else format(value, pattern)


def markdown_table(result: dict) -> str:
    """The trade-off table; speed ratios are against fp32 eager of the same run."""
    rows = result["rows"]
    base = next((r for r in rows if r["engine"] == "eager" and r["precision"] == "fp32" and r["available"]), None)
    lines = [
        (f"batch-1 latency: one {result['config']['new_tokens']}-token generation (median of {result['config']['latency_runs']}); "
        f"throughput: batch {result['config']['batch']} (median of {result['config']['throughput_runs']}); model {result['model']}"),
        "",
        ("| engine | precision | task accuracy | token agreement | rows identical | oracle-exact | max abs logit diff "
        "| latency b=1 (ms) | vs eager | throughput (tok/s) | vs eager | conversion (s) | artifact (MB) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["available"]:
            lines.append(f"| {r['engine']} | {r['precision']} | unavailable: {r['reason']} |||||||||||")
            continue
        speedup = _fmt(base["latency_b1_ms"] / r["latency_b1_ms"], ".2f") + "x" if base else ""
        gain = _fmt(r["throughput_tok_s"] / base["throughput_tok_s"], ".2f") + "x" if base else ""
        conversion = _fmt(r["conversion_s"], ".1f") + (" (cached)" if r["conversion_from_cache"] else "")
        exact = "" if r["oracle_exact"] is None else ("yes" if r["oracle_exact"] else "NO")
        lines.append(
            f"| {r['engine']} | {r['precision']} | {100 * r['accuracy']:.1f} % | {100 * r['token_agreement']:.1f} % "
            f"| {r['rows_identical']} | {exact} | {r['max_logit_diff']:.2e} | {r['latency_b1_ms']:.1f} | {speedup} "
            f"| {r['throughput_tok_s']:.0f} | {gain} | {conversion} | {_fmt(r['artifact_mb'], '.1f')} |"
        )
    best = fastest_within_tolerance(rows, result["environment"]["device"])
    if best:
        lines += ["", (f"The auto rule's choice at batch {result['config']['batch']}: **{best['engine']}/{best['precision']}** "
                       f"(within {100 * ACCURACY_TOLERANCE:.0f} points of fp32's task accuracy, and faster than fp32 "
                       f"eager by {MIN_SPEEDUP:.2f}x or more).")]
    lines += ["", "Conversion notes:"]
    lines += [f"- {r['engine']}/{r['precision']}: " + "; ".join(r["notes"]) for r in rows if r["available"] and r["notes"]]
    env = result["environment"]
    lines += ["", (f"Machine: {env['cpu_model']}, {env['logical_cores']} logical cores, torch threads {env['torch_threads']}, "
              f"load average at start {env['load_average_at_start']}, device {env['device']}; one process timing the "
              f"engines directly, no server and no load generator (nothing pinned); "
              f"packages {json.dumps(env['packages'])}; git {str(env['git_commit'])[:10]} dirty={env['git_dirty']}.")]
    return "\n".join(lines)


def fastest_within_tolerance(rows: list[dict], device: str = "cpu") -> dict | None:
    """The row chapter 5's rule (:func:`~chapters.ch05_inference_engine.engines.pick`) chooses from this
    table among the rule's candidates for ``device`` (``CANDIDATES``), its throughput at batch 32
    standing for the rule's probe. None without an fp32 eager row."""
    candidates = set(CANDIDATES.get(device.split(":")[0], CANDIDATES["cpu"]))
    available = [r for r in rows if r["available"] and (r["engine"], r["precision"]) in candidates]
    if not any((r["engine"], r["precision"]) == ("eager", "fp32") for r in available):
        return None
    chosen = pick([{**r, "requests_per_s": r["throughput_tok_s"]} for r in available])
    return next(r for r in available if (r["engine"], r["precision"]) == chosen)


def save(result: dict, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stamp = result["created"].replace(":", "").replace("-", "")
    path = directory / f"tradeoffs-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    (directory / "latest.json").write_text(json.dumps(result, indent=2) + "\n")
    (directory / "latest.md").write_text(markdown_table(result) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.tradeoffs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--weights", default="default", help="default | path (accuracy only means something for the default model)")
    parser.add_argument("--preset", default="tiny", help="model shape for --weights dummy: tiny | gpt2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads (1: what the harness gives every server on the cpu profile)")
    parser.add_argument("--batch", type=int, default=32, help="batch size of the throughput measurement")
    parser.add_argument("--latency-runs", type=int, default=7)
    parser.add_argument("--throughput-runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the JSON and markdown go")
    parser.add_argument("--save-reference", action="store_true",
                        help=f"also write the results into {REFERENCE_DIR.relative_to(PROJECT_ROOT)} (committed with the lesson)")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: print the table of a results file written earlier")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        print(markdown_table(json.loads(args.render.read_text())))
        return
    result = run(args)
    path = save(result, args.out)
    if args.save_reference:
        save(result, REFERENCE_DIR)
    print(markdown_table(result))
    print(f"\nwritten: {path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path}")


if __name__ == "__main__":
    main()
