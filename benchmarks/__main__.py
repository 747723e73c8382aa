"""python -m benchmarks <command>: measure chapters, draw the climb, keep reference results, fill the READMEs.

    run       one chapter:       --chapter ch02 --profile cpu [--workload long] [--server-arg=--workers=2 --label ch01-workers]
    climb     every chapter:     --profile auto [--chapters ch01,ch02] [--ceiling] [--save-reference]
    openloop  offered rates swept upward (Poisson arrivals): --profile cpu --chapters ch02,ch06 [--rates 2,5,10]
    ceiling   the harness's own limit (Locust against an instant endpoint)  [--workers N]
    report    redraw the table and plots from a results directory
    reference copy results/<profile>/ to reference/<profile>/ (committed) and redraw there
    readme    rewrite the <!-- results:KEY --> blocks of README.md, benchmarks/RESULTS.md, chapters/*/README.md,
              chapters/*/RESULTS.md and benchmarks/studies/*/README.md

run, climb, openloop and ceiling take --workers N: Locust's distributed mode for the load generator.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.harness.profiles import PROFILE_NAMES, get_profile, resolve_profile_name, weights_name
from benchmarks.harness.results import REFERENCE_ROOT, RESULTS_ROOT
from benchmarks.harness.workload import WORKLOADS


def _levels(text: str) -> list[int]:
    levels = sorted({int(part) for part in text.split(",") if part.strip()})
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("levels are positive user counts, e.g. 1,8,32")
    return levels


def _rates(text: str) -> list[float]:
    try:
        rates = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError("rates are requests per second, e.g. 2,5,10") from None
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("rates are positive requests per second, e.g. 2,5,10")
    return rates


def _loadgen_workers(text: str) -> int:
    try:
        workers = int(text)
    except ValueError:
        workers = -1
    if workers < 0:
        raise argparse.ArgumentTypeError("--workers is 0 (one Locust process) or a positive number of Locust workers")
    return workers


def _add_loadgen(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", type=_loadgen_workers, default=0, dest="loadgen_workers", metavar="N",
        help="Locust workers, for the load generator (the server's own --workers goes in --server-arg): 0, the "
             "default, runs Locust as one process, as before; N >= 1 runs Locust's distributed mode, a master and N "
             "worker processes on 127.0.0.1 only, the users (or the open loop's rate) split between the workers and "
             "every worker's requests merged; each worker gets its own core where the machine has one to spare",
    )


def _add_common(parser: argparse.ArgumentParser, *, profile_default: str = "auto") -> None:
    parser.add_argument("--profile", choices=PROFILE_NAMES, default=profile_default, help="auto: gpu where CUDA is available, else cpu")
    parser.add_argument("--out", type=Path, help="results directory (default: benchmarks/results/<profile>)")


def _add_measuring(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    parser.add_argument("--levels", type=_levels, help="override the profile's concurrency levels, e.g. 1,8")
    parser.add_argument("--weights", help="override the profile's --weights (dummy, a .safetensors file, a GPT-2 directory)")
    parser.add_argument("--save-reference", action="store_true", help="also copy the results to benchmarks/reference/<profile>/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="benchmark one chapter")
    run.add_argument("--chapter", required=True)
    run.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                     help="extra server flag, repeatable; write it as --server-arg=--workers=2")
    run.add_argument("--label", help="name of this variant's results (default: the chapter id)")
    _add_common(run)
    _add_measuring(run)
    _add_loadgen(run)
    run.add_argument("--no-calibration", action="store_true", help="skip the machine's calibration (a few seconds)")

    climb = commands.add_parser("climb", help="benchmark every chapter in order, then the table and plots")
    climb.add_argument("--chapters", type=lambda text: [c.strip() for c in text.split(",") if c.strip()])
    climb.add_argument("--ceiling", action="store_true", help="measure the harness's ceiling first")
    climb.add_argument("--repeat", type=int, default=1, metavar="N",
                       help="N interleaved rounds; each chapter keeps its median run (a shared machine's noise)")
    _add_common(climb)
    _add_measuring(climb)
    _add_loadgen(climb)

    openloop = commands.add_parser("openloop", help="offered rates swept upward per chapter (the knee)")
    openloop.add_argument("--chapters", type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
                          help="default: every built chapter")
    openloop.add_argument("--rates", type=_rates, help="override the profile's ladder of offered rates (requests/s)")
    openloop.add_argument("--server-arg", action="append", default=[], metavar="FLAG")
    openloop.add_argument("--label", help="name of a variant's results (one chapter only)")
    _add_common(openloop)
    openloop.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    openloop.add_argument("--weights", help="override the profile's --weights")
    openloop.add_argument("--save-reference", action="store_true", help="also copy the results to benchmarks/reference/<profile>/openloop/")
    _add_loadgen(openloop)

    ceiling = commands.add_parser("ceiling", help="the load generator's own ceiling against an instant endpoint")
    ceiling.add_argument("--save-reference", action="store_true")
    _add_common(ceiling)
    _add_loadgen(ceiling)

    report = commands.add_parser("report", help="redraw the table and plots from existing results")
    report.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    report.add_argument("--reference", action="store_true", help="read benchmarks/reference/<profile>/ instead")
    report.add_argument("--weights", help="the results of a climb run with these --weights (benchmarks/results/<profile>-<name>)")
    _add_common(report, profile_default="cpu")

    reference = commands.add_parser("reference", help="copy results/<profile>/ to reference/<profile>/ and redraw")
    reference.add_argument("--labels", type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
                           help="only these runs (default: every result of the profile, the ceiling included)")
    reference.add_argument("--weights", help="the results of a climb run with these --weights")
    _add_common(reference, profile_default="cpu")

    readme = commands.add_parser("readme", help="rewrite the results blocks of the READMEs from reference results")
    readme.add_argument("--profile", choices=("smoke", "cpu", "gpu"), default="cpu")
    readme.add_argument("--dir", type=Path, help="results to use (default: benchmarks/reference/<profile>)")
    readme.add_argument("files", nargs="*", type=Path, help="default: README.md, benchmarks/RESULTS.md, chapters/*/README.md and RESULTS.md, benchmarks/studies/*/README.md")
    return parser


def _print_report(directory: Path, workload: str, notes: dict[str, str] | None = None) -> None:
    from benchmarks.report import write_report

    files = write_report(directory, workload, notes)
    print()
    print(files.markdown)
    print(f"table: {files.table}\nplots: {files.climb_png}\n       {files.latency_png}")


def _save_reference(paths: list[Path], profile: str) -> None:
    from benchmarks.report.reference import save_reference

    for files in save_reference(paths, profile):
        print(f"reference results saved: {files.table.parent}")


def cmd_run(args: argparse.Namespace) -> int:
    from benchmarks.harness.climb import chapter_is_built, run_chapter

    if not chapter_is_built(args.chapter):
        print(f"{args.chapter}: not built yet (no chapters/<folder>/__main__.py), nothing to measure", file=sys.stderr)
        return 2
    profile = get_profile(args.profile, args.weights)
    result, path = run_chapter(
        args.chapter, profile, workload=args.workload, extra_server_args=args.server_arg, label=args.label,
        out_dir=args.out, levels=args.levels, weights=args.weights, calibrate=not args.no_calibration,
        loadgen_workers=args.loadgen_workers,
    )
    _print_report(path.parent, args.workload)
    if args.save_reference:
        _save_reference([path], profile.results_name)
    return 0


def cmd_climb(args: argparse.Namespace) -> int:
    from benchmarks.harness.climb import climb, climb_repeated, results_dir

    profile = get_profile(args.profile, args.weights)
    served = f", weights {args.weights!r}" if profile.model else ""
    print(f"climb on the {profile.name!r} profile (asked: {args.profile}){served}, workload {args.workload!r}")
    began = time.monotonic()
    saved: list[Path] = []
    if args.ceiling:
        from benchmarks.harness.ceiling import run_ceiling

        saved.append(run_ceiling(profile, out_dir=args.out, workers=args.loadgen_workers)[1])
    options = dict(chapters=args.chapters, workload=args.workload, levels=args.levels, weights=args.weights,
                   loadgen_workers=args.loadgen_workers)
    if args.repeat > 1:
        outcome = climb_repeated(profile, args.repeat, out_dir=args.out, **options)
    else:
        outcome = climb(profile, out_dir=args.out, **options)
    print(f"climb finished in {time.monotonic() - began:.0f} s")
    notes = {chapter: "failed" for chapter in outcome.failed}
    _print_report(results_dir(profile, args.out), args.workload, notes)
    for chapter, error in outcome.failed.items():
        print(f"FAILED {chapter}: {error[:500]}", file=sys.stderr)
    if args.save_reference:
        _save_reference([*saved, *outcome.written.values()], profile.results_name)
    return 1 if outcome.failed else 0


def cmd_openloop(args: argparse.Namespace) -> int:
    from benchmarks.harness.climb import open_loop_climb, results_dir

    if args.label and (not args.chapters or len(args.chapters) != 1):
        print("--label names one chapter's variant: give exactly one --chapters", file=sys.stderr)
        return 2
    profile = get_profile(args.profile, args.weights)
    began = time.monotonic()
    outcome = open_loop_climb(
        profile, chapters=args.chapters, rates=args.rates, workload=args.workload,
        extra_server_args=args.server_arg, label=args.label, out_dir=args.out, weights=args.weights,
        loadgen_workers=args.loadgen_workers,
    )
    print(f"open-loop sweep finished in {time.monotonic() - began:.0f} s")
    _print_report(results_dir(profile, args.out), args.workload)
    for chapter, error in outcome.failed.items():
        print(f"FAILED {chapter}: {error[:500]}", file=sys.stderr)
    if args.save_reference:
        _save_reference(list(outcome.written.values()), profile.results_name)
    return 1 if outcome.failed else 0


def cmd_ceiling(args: argparse.Namespace) -> int:
    from benchmarks.harness.ceiling import run_ceiling

    profile = get_profile(args.profile)
    _, path = run_ceiling(profile, out_dir=args.out, workers=args.loadgen_workers)
    if args.save_reference:
        _save_reference([path], profile.name)
    return 0


def _results_name(args: argparse.Namespace) -> str:
    """The results folder of ``--profile`` and ``--weights``, as :attr:`Profile.results_name` names it."""
    name = resolve_profile_name(args.profile)
    return f"{name}-{weights_name(args.weights)}" if args.weights else name


def cmd_report(args: argparse.Namespace) -> int:
    profile = _results_name(args)
    root = REFERENCE_ROOT if args.reference else RESULTS_ROOT
    directory = args.out or root / profile
    if not directory.exists():
        print(f"no results in {directory}", file=sys.stderr)
        return 2
    _print_report(directory, args.workload)
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from benchmarks.harness.results import load_result

    profile = _results_name(args)
    source = args.out or RESULTS_ROOT / profile
    paths = sorted(source.glob("*.json"))
    if args.labels:
        paths = [p for p in paths if load_result(p).label in args.labels]
    if not paths:
        print(f"no results to save in {source}", file=sys.stderr)
        return 2
    _save_reference(paths, profile)
    return 0


def cmd_readme(args: argparse.Namespace) -> int:
    from benchmarks.report.readme_blocks import update_readmes

    changed = update_readmes(args.files or None, profile=args.profile, directory=args.dir)
    for path in changed:
        print(f"rewrote {path}")
    if not changed:
        print("no results block changed")
    return 0


COMMANDS = {
    "run": cmd_run, "climb": cmd_climb, "openloop": cmd_openloop, "ceiling": cmd_ceiling,
    "report": cmd_report, "reference": cmd_reference, "readme": cmd_readme,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
