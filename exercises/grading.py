"""Run the graded tests against a tree and sum them up per exercise.

The tests are this repository's (``tests/test_exercises_*.py``), the code is the tree's: pytest runs
in a subprocess whose working directory and ``PYTHONPATH`` are the tree, so ``import chapters``
finds the learner's code before the installed (editable) solution, and the plugin refuses to go on
if it does not (``EXERCISES_TREE``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from exercises.course import STEPS
from exercises.markers import STUB_ID_IN_TEXT, Exercise
from exercises.pytest_plugin import REPORT_ENV, STUB_ENV, TREE_ENV

GRADED_TESTS_GLOB = "test_exercises_ch*.py"
PASSED, FAILED, NOT_ATTEMPTED, BLOCKED, NO_TEST = "passed", "failed", "not attempted", "blocked", "no graded test"


@dataclass
class ExerciseGrade:
    exercise: Exercise
    status: str
    passed: int = 0
    total: int = 0
    blocked_by: list[str] = field(default_factory=list)  # other exercises whose stubs its tests ran into
    failures: dict[str, str] = field(default_factory=dict)  # nodeid -> failure text


@dataclass
class GradeRun:
    returncode: int
    output: str
    results: dict[str, dict]  # nodeid -> {"exercises", "outcome", "text"}


def graded_test_files(tests_dir: Path) -> list[Path]:
    return sorted(Path(tests_dir).glob(GRADED_TESTS_GLOB))


def run_graded_tests(
    tree: Path,
    exercises: list[Exercise],
    *,
    tests_dir: Path,
    junit: Path | None = None,
    stub: str | None = None,
    extra_args: list[str] | None = None,
    timeout_s: float = 900,
) -> GradeRun:
    """Run the graded tests of ``exercises`` (from ``tests_dir``) on the code in ``tree``.

    ``stub`` (a toggle tree only): what to stub while each graded test runs (``own`` or ``around``,
    see :mod:`exercises.pytest_plugin`).
    """
    tree = Path(tree).resolve()
    files = graded_test_files(tests_dir)
    if not files:
        raise FileNotFoundError(f"no graded tests ({GRADED_TESTS_GLOB}) in {tests_dir}")
    with tempfile.TemporaryDirectory(prefix="grade-") as scratch:
        report = Path(scratch) / "report.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               TREE_ENV: str(tree), REPORT_ENV: str(report), "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop(STUB_ENV, None)
        if stub is not None:
            env[STUB_ENV] = stub
        command = [sys.executable, "-m", "pytest", *map(str, files), "-m", "exercise", "-q", "-p", "no:cacheprovider",
                   "-o", "console_output_style=classic", "--tb=native", *(f"--exercise={e.id}" for e in exercises),
                   # This repository's pytest settings put its own root first on the path; the tree goes there instead.
                   "-o", f"pythonpath={tree}"]
        if junit is not None:
            command.append(f"--junitxml={Path(junit).resolve()}")
        command += extra_args or []
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        results = json.loads(report.read_text(encoding="utf-8")) if report.exists() else {}
    return GradeRun(done.returncode, done.stdout + done.stderr, results)


def grade(exercises: list[Exercise], run: GradeRun) -> list[ExerciseGrade]:
    """Passed (every graded test passed), not attempted (a test hit its own stub), blocked (its tests
    failed only on other exercises' stubs), or failed."""
    grades = []
    for exercise in exercises:
        mine = {nodeid: r for nodeid, r in run.results.items() if exercise.id in r["exercises"]}
        failures = {nodeid: r["text"] for nodeid, r in mine.items() if r["outcome"] == "failed"}
        stubs_hit = {found for text in failures.values() for found in STUB_ID_IN_TEXT.findall(text)}
        if not mine:
            status = NO_TEST
        elif not failures and all(r["outcome"] == "passed" for r in mine.values()):
            status = PASSED
        elif exercise.id in stubs_hit:
            status = NOT_ATTEMPTED
        elif stubs_hit and all(STUB_ID_IN_TEXT.search(text) for text in failures.values()):
            status = BLOCKED  # every failure is another exercise's stub: do that one first
        else:
            status = FAILED
        grades.append(ExerciseGrade(
            exercise, status,
            passed=sum(r["outcome"] == "passed" for r in mine.values()), total=len(mine),
            blocked_by=sorted(stubs_hit - {exercise.id}), failures=failures,
        ))
    return grades


def format_table(grades: list[ExerciseGrade]) -> str:
    """One row per exercise, grouped by chapter."""
    rows = [("exercise", "status", "tests passed", "title", "note")]
    for g in grades:
        note = ""
        if g.blocked_by:
            needs = [i for i in g.blocked_by if i in STEPS[g.exercise.id].needs] if g.exercise.id in STEPS else []
            note = f"its tests stopped at the stub of {', '.join(g.blocked_by)}" + (
                f" (it needs {', '.join(needs)}: do that first)" if needs else "")
        elif g.status == FAILED and g.failures:
            note = f"first failure: {next(iter(g.failures)).rsplit('::', 1)[-1]}"
        rows.append((g.exercise.id, g.status, f"{g.passed}/{g.total}", g.exercise.title, note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    chapter = None
    for index, row in enumerate(rows):
        if index > 0 and grades[index - 1].exercise.chapter != chapter:
            chapter = grades[index - 1].exercise.chapter
            lines.append(f"-- {chapter}")
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    summary = {status: sum(g.status == status for g in grades) for status in (PASSED, FAILED, NOT_ATTEMPTED, BLOCKED, NO_TEST)}
    lines.append(", ".join(f"{count} {status}" for status, count in summary.items() if count))
    return "\n".join(lines)
