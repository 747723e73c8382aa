"""``python -m exercises``: list the exercises, write a student tree, grade a tree.

    python -m exercises list [--chapter ch03]                  # in the course's order, with time and prerequisites
    python -m exercises student --chapter ch03 [--out DIR]     # or --all
    python -m exercises grade --tree DIR [--chapter ch03] [--junit FILE]
    python -m exercises key --chapter ch03 --out DIR           # the solution diffs, one per exercise
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exercises.course import STEPS
from exercises.grading import PASSED, format_table, grade, run_graded_tests
from exercises.key import write_key
from exercises.markers import MarkerError, discover, select
from exercises.tree import repository_root, student_tree


def _chapters(values: list[str] | None) -> list[str] | None:
    return None if not values else [value.split("_")[0] for value in values]  # ch03 or ch03_dynamic_batching


def in_course_order(exercises: list) -> list:
    """The course's order (``exercises/course.py``); an exercise it does not list yet goes last."""
    order = list(STEPS)
    return sorted(exercises, key=lambda e: (order.index(e.id) if e.id in order else len(order), e.id))


def cmd_list(args: argparse.Namespace) -> int:
    for exercise in in_course_order(select(discover(args.source), _chapters(args.chapter))):
        step = STEPS.get(exercise.id)
        plan = f"{step.minutes} min" + (f", after {', '.join(step.needs)}" if step.needs else "") if step else "not in the course plan"
        print(f"{exercise.id:7} {exercise.title}  ({plan})")
        for function in exercise.functions:
            print(f"        {function}")
        print(f"        check: pytest -m {exercise.marker_name}   hint: {exercise.readme_link}")
    return 0


def cmd_student(args: argparse.Namespace) -> int:
    if not args.all and not args.chapter:
        raise SystemExit("choose the chapter(s) to hand out (--chapter ch03, repeatable) or --all")
    chapters = None if args.all else _chapters(args.chapter)
    name = "all" if chapters is None else "-".join(chapters)
    out = args.out or args.source.parent / f"{args.source.name}-student-{name}"
    chosen, rewritten = student_tree(args.source, out, chapters)
    print(f"wrote {out}: {len(chosen)} exercises stubbed in {len(rewritten)} files")
    for exercise in chosen:
        print(f"  {exercise.id:7} {exercise.title}  ({', '.join(exercise.functions)})")
    print(f"grade it with: python -m exercises grade --tree {out}" + "".join(f" --chapter {c}" for c in chapters or []))
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    tree = args.tree.resolve()
    if not (tree / "chapters").is_dir():
        raise SystemExit(f"{tree} has no chapters/ folder: is it a student tree?")
    exercises = select(discover(tree), _chapters(args.chapter))
    tests_dir = args.tests or repository_root() / "tests"
    junit = args.junit or tree.parent / f"{tree.name}-exercise-results.xml"  # beside the tree, never in it
    run = run_graded_tests(tree, exercises, tests_dir=tests_dir, junit=junit)
    grades = grade(exercises, run)
    if args.verbose or run.returncode not in (0, 1):
        print(run.output)  # pytest itself failed (collection error, wrong tree, a crash): show why
    if run.returncode not in (0, 1):
        print(f"pytest stopped with exit status {run.returncode}: the table below may be incomplete", file=sys.stderr)
    print(f"graded {tree} with the tests in {tests_dir}")
    print(format_table(grades))
    print(f"JUnit XML: {junit}")
    if run.returncode not in (0, 1):
        return 2
    return 0 if all(g.status == PASSED for g in grades) else 1


def cmd_key(args: argparse.Namespace) -> int:
    if not args.all and not args.chapter:
        raise SystemExit("choose the chapter(s) whose answer key to write (--chapter ch03, repeatable) or --all")
    chosen = in_course_order(select(discover(args.source), None if args.all else _chapters(args.chapter)))
    out = args.out.resolve()
    if out == args.source or args.source in out.parents:
        raise ValueError(f"write the key outside the repository (learners' trees are copies of it): {out}")
    for path in write_key(args.source, chosen, out):
        print(f"wrote {path}")
    print("a learner applies one with: git apply <id>.diff   (or: patch -p1 < <id>.diff) at the top of the tree")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exercises", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=repository_root(), help="the solution repository (default: this one)")
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("list", help="the exercises marked in the chapters")
    listing.add_argument("--chapter", action="append", help="only this chapter (repeatable)")
    listing.set_defaults(run=cmd_list)

    student = commands.add_parser("student", help="write a copy of the repository with exercises stubbed")
    student.add_argument("--chapter", action="append", help="stub this chapter's exercises (repeatable), e.g. ch03")
    student.add_argument("--all", action="store_true", help="stub every exercise: the solution-free export")
    student.add_argument("--out", type=Path, help="where to write it (default: <repo>-student-<chapter> beside the repository)")
    student.set_defaults(run=cmd_student)

    grader = commands.add_parser("grade", help="run the graded tests against a tree; one row per exercise")
    grader.add_argument("--tree", type=Path, required=True, help="the tree to grade (a student tree, or this repository)")
    grader.add_argument("--chapter", action="append", help="only this chapter's exercises (repeatable)")
    grader.add_argument("--junit", type=Path, help="JUnit XML output (default: beside the tree, <DIR>-exercise-results.xml)")
    grader.add_argument("--tests", type=Path, help="the graded tests' folder (default: this repository's tests/)")
    grader.add_argument("-v", "--verbose", action="store_true", help="print pytest's output too")
    grader.set_defaults(run=cmd_grade)

    key = commands.add_parser("key", help="write the answer key: one solution diff per exercise")
    key.add_argument("--chapter", action="append", help="this chapter's exercises (repeatable), e.g. ch03")
    key.add_argument("--all", action="store_true", help="every exercise")
    key.add_argument("--out", type=Path, required=True, help="the folder to write <id>.diff into (outside the repository)")
    key.set_defaults(run=cmd_key)

    args = parser.parse_args(argv)
    args.source = args.source.resolve()
    try:
        return args.run(args)
    except (MarkerError, ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
