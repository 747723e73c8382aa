"""Sweep the batcher's knobs with the benchmark harness and keep the best: ``python -m benchmarks.autotune``.

Every combination of ``--max-batch`` x ``--min-batch`` x ``--window-ms`` runs as chapter 6's real
server under the harness's real load (the profile's cores, threads and model). The objective,
stated and applied as is: **the highest QPS whose P99 at that load stays under ``--slo-p99-ms``**.
The table of every run is printed, the best one marked, and the choice written to ``tuned.json``
(which the ch06 server reads) with the figures and the results files it came from.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.harness.climb import run_chapter
from benchmarks.harness.profiles import PROFILE_NAMES, get_profile
from benchmarks.harness.results import REPO_ROOT, RESULTS_ROOT, BenchmarkResult
from chapters.ch06_tuned_batching.server import TUNED_CONFIG


@dataclass(frozen=True)
class Candidate:
    max_batch: int
    min_batch: int
    window_ms: float

    @property
    def label(self) -> str:
        return f"ch06-tune-b{self.max_batch}-m{self.min_batch}-w{self.window_ms:g}"

    def server_args(self) -> list[str]:
        return [f"--max-batch={self.max_batch}", f"--min-batch={self.min_batch}",
                f"--window-ms={self.window_ms:g}", "--tuned-config=none"]


@dataclass(frozen=True)
class Trial:
    candidate: Candidate
    users: int  # the load at which this candidate gave its highest QPS
    qps: float
    p50_ms: float
    p99_ms: float
    errors: int
    results_file: str

    def meets(self, slo_p99_ms: float) -> bool:
        return self.errors == 0 and self.p99_ms <= slo_p99_ms


def candidates(max_batches: list[int], min_batches: list[int], windows_ms: list[float]) -> list[Candidate]:
    """Every combination in which a batch can actually reach ``min_batch`` (min <= max)."""
    return [Candidate(b, m, w) for b, m, w in itertools.product(max_batches, min_batches, windows_ms) if m <= b]


def summarize(candidate: Candidate, result: BenchmarkResult, path: Path) -> Trial:
    best = result.saturation()
    if best is None or best.latency_ms is None:
        raise ValueError(f"{candidate.label}: the run measured no successful level")
    return Trial(candidate, best.users, best.qps, best.latency_ms.p50, best.latency_ms.p99,
                 sum(best.errors_by_status.values()), _repo_relative(path))


def _repo_relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def choose(trials: list[Trial], slo_p99_ms: float) -> Trial | None:
    """The objective: highest QPS among the trials that meet the SLO with no errors (None if none does)."""
    eligible = [t for t in trials if t.meets(slo_p99_ms)]
    return max(eligible, key=lambda t: t.qps, default=None)


def table(trials: list[Trial], chosen: Trial | None, slo_p99_ms: float) -> str:
    lines = [
        f"| max_batch | min_batch | window ms | users | QPS | P50 ms | P99 ms | errors | P99 <= {slo_p99_ms:g} ms | |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|:---|",
    ]
    for t in trials:
        c = t.candidate
        mark = "**chosen**" if t is chosen else ""
        lines.append(f"| {c.max_batch} | {c.min_batch} | {c.window_ms:g} | {t.users} | {t.qps:.1f} | "
                     f"{t.p50_ms:.0f} | {t.p99_ms:.0f} | {t.errors} | {'yes' if t.meets(slo_p99_ms) else 'no'} | {mark} |")
    return "\n".join(lines)


def write_choice(path: Path, chosen: Trial, trials: list[Trial], args: argparse.Namespace, environment: dict) -> None:
    document = {
        "chosen": asdict(chosen.candidate),
        "objective": f"highest QPS with P99 <= {args.slo_p99_ms:g} ms and no errors",
        "profile": args.profile,
        "levels": args.levels,
        "measured": {k: v for k, v in asdict(chosen).items() if k != "candidate"},
        "trials": [{**asdict(t.candidate), **{k: v for k, v in asdict(t).items() if k != "candidate"}} for t in trials],
        "environment": environment,
        "reproduce": "python -m benchmarks.autotune " + " ".join(args.argv),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def show(document: dict) -> str:
    """The tuning table of a written ``tuned.json``, the chosen row marked, with how it was made."""
    trials = [Trial(Candidate(t["max_batch"], t["min_batch"], t["window_ms"]), t["users"], t["qps"], t["p50_ms"],
                    t["p99_ms"], t["errors"], t["results_file"]) for t in document["trials"]]
    chosen = next(t for t in trials if asdict(t.candidate) == document["chosen"])
    slo = float(document["objective"].split("<= ")[1].split(" ms")[0])
    env = document["environment"]
    return "\n".join([
        table(trials, chosen, slo), "",
        f"Objective: {document['objective']}. Profile `{document['profile']}` at {document['levels']} users; "
        f"{env.get('cpu_model')}, {env.get('logical_cores')} cores, torch {env.get('torch')}, commit "
        f"{(env.get('git_commit') or '?')[:10]}{' (dirty)' if env.get('git_dirty') else ''}.",
        f"Reproduce: `{document['reproduce']}`; shown by `python -m benchmarks.autotune --show`.",
    ])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILE_NAMES, default="cpu")
    parser.add_argument("--max-batch", type=_ints, default=[32, 64])
    parser.add_argument("--min-batch", type=_ints, default=[8, 16])
    parser.add_argument("--window-ms", type=_floats, default=[3.0, 5.0])
    parser.add_argument("--levels", type=_ints, default=[64], help="loads to measure each candidate at (default: the saturating one)")
    parser.add_argument("--slo-p99-ms", type=float, default=2000.0, help="the P99 a chosen configuration must stay under")
    parser.add_argument("--out", type=Path, default=TUNED_CONFIG, help="where the choice goes (the ch06 server reads tuned.json)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for every candidate's server, repeatable: --server-arg=--engine=eager")
    parser.add_argument("--show", action="store_true", help="print the table of the tuned file (--out) and exit")
    parser.add_argument("--results", type=Path, help="results directory (default: benchmarks/results/autotune-<profile>)")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    if args.show:
        print(show(json.loads(args.out.read_text())))
        return
    profile = get_profile(args.profile)
    results_dir = args.results or RESULTS_ROOT / f"autotune-{profile.name}"

    trials: list[Trial] = []
    environment: dict = {}
    grid = candidates(args.max_batch, args.min_batch, args.window_ms)
    for number, candidate in enumerate(grid, start=1):
        print(f"[{number}/{len(grid)}] {candidate.label}", flush=True)
        result, path = run_chapter("ch06", profile, extra_server_args=[*candidate.server_args(), *args.server_arg], label=candidate.label,
                                   out_dir=results_dir, levels=args.levels)
        trials.append(summarize(candidate, result, path))
        environment = result.environment.model_dump()

    chosen = choose(trials, args.slo_p99_ms)
    print(table(trials, chosen, args.slo_p99_ms))
    if chosen is None:
        raise SystemExit(f"no configuration met P99 <= {args.slo_p99_ms:g} ms without errors; {args.out} left as it was")
    write_choice(args.out, chosen, trials, args, environment)
    print(f"chosen: {chosen.candidate} ({chosen.qps:.1f} QPS, P99 {chosen.p99_ms:.0f} ms at {chosen.users} users); wrote {args.out}")


if __name__ == "__main__":
    main()
