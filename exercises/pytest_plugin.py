"""The pytest side of the exercises (loaded by ``tests/conftest.py``).

- A graded test says what it grades: ``@pytest.mark.exercise("ch03.1")`` (several ids allowed).
- Each exercise marked in the chapters gets its own marker, so ``pytest -m ch03_1`` selects its
  graded tests; ``pytest --exercise ch03.1`` does the same by id (repeatable).
- ``EXERCISES_TREE=DIR`` (set by ``python -m exercises grade``): stop at once unless ``chapters``
  and ``shared`` are imported from DIR, so an installed copy can never be graded by mistake.
- ``EXERCISES_REPORT=FILE``: write each graded test's exercises, outcome and failure text as JSON
  (the grade table is built from it).
- On a Python whose parser may fail inside pytest's failure report (:data:`AST_DEPTH_BUG`), tracebacks
  are Python's own (``--tb=native``) unless another style is asked for, so a failing check still ends
  in a summary that names the exercise.
- ``EXERCISES_STUB=own`` (the meta-test, on a toggle tree only): while a graded test runs, its own
  exercises are stubbed, so its failure shows what a learner who has not written them would see.
  ``EXERCISES_STUB=around``: its own exercises and what they need (``exercises/course.py``) are
  solved and every other exercise of their chapter and of later chapters is stubbed, so it passes
  only if the course's order lets a learner pass it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from exercises import toggle
from exercises.course import stubbed_around
from exercises.markers import check_id, discover, marker_name

EXERCISE_MARK = "exercise"
TREE_ENV = "EXERCISES_TREE"
REPORT_ENV = "EXERCISES_REPORT"
STUB_ENV = "EXERCISES_STUB"
STUB_MODES = ("own", "around")


def _chapters_root() -> Path:
    import chapters

    return Path(chapters.__file__).resolve().parent.parent


def exercise_ids(item: pytest.Item) -> list[str]:
    """The exercise ids a test grades (from its ``exercise`` markers)."""
    ids = []
    for mark in item.iter_markers(EXERCISE_MARK):
        if not mark.args:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.exercise needs the exercise id, e.g. exercise('ch03.1')")
        ids.extend(check_id(str(arg)) for arg in mark.args)
    return ids


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exercise", action="append", default=[], metavar="ID",
        help="run only the graded tests of exercise ID (e.g. ch03.1); repeatable",
    )


# CPython before gh-106905's fix (3.11.8, 3.12.2) may raise "AST constructor recursion depth mismatch"
# while pytest parses source to format a failure: the run ends in INTERNALERROR, with no summary naming
# the failing exercise. Python's own traceback format parses nothing.
AST_DEPTH_BUG = (3, 11) <= sys.version_info[:3] < (3, 11, 8) or (3, 12) <= sys.version_info[:3] < (3, 12, 2)


def pytest_configure(config: pytest.Config) -> None:
    if AST_DEPTH_BUG and config.option.tbstyle == "auto":
        config.option.tbstyle = "native"
    for exercise in discover(_chapters_root()):
        config.addinivalue_line("markers", f"{exercise.marker_name}: graded tests of exercise {exercise.id} ({exercise.title})")
    if os.environ.get(REPORT_ENV):
        config.pluginmanager.register(ExerciseReport(Path(os.environ[REPORT_ENV])), "exercise-report")


def pytest_sessionstart(session: pytest.Session) -> None:
    tree = os.environ.get(TREE_ENV)
    if not tree:
        return
    tree_path = Path(tree).resolve()
    import chapters
    import shared

    for package in (chapters, shared):
        origin = Path(package.__file__).resolve()
        if tree_path not in origin.parents:
            pytest.exit(f"grading {tree_path}, but {package.__name__} was imported from {origin.parent}: "
                        "run pytest with that tree as the working directory and first on PYTHONPATH", returncode=4)


@pytest.hookimpl(tryfirst=True)  # before -m filters: the per-exercise markers must already be there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = {check_id(i) for i in config.getoption("--exercise")}
    selected, deselected = [], []
    for item in items:
        ids = exercise_ids(item)
        for exercise_id in ids:
            item.add_marker(marker_name(exercise_id))
            item.user_properties.append(("exercise", exercise_id))
        (selected if not wanted or wanted & set(ids) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(autouse=True)
def _stub_while_graded(request: pytest.FixtureRequest) -> Iterator[None]:
    """On a toggle tree with ``EXERCISES_STUB``: stub what the mode says while this graded test runs."""
    mode = os.environ.get(STUB_ENV)
    own = set(exercise_ids(request.node))
    if mode not in STUB_MODES or not own:
        yield
        return
    toggle.set_stubbed(own if mode == "own" else stubbed_around(own))
    try:
        yield
    finally:
        toggle.set_stubbed(set())


class ExerciseReport:
    """Collects each graded test's outcome; writes them to ``EXERCISES_REPORT`` at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, dict] = {}  # nodeid -> {"exercises", "outcome", "text"}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        ids = [value for name, value in report.user_properties if name == "exercise"]
        if not ids:
            return
        entry = self.results.setdefault(report.nodeid, {"exercises": ids, "outcome": "passed", "text": ""})
        if report.failed:
            entry["outcome"] = "failed"
            entry["text"] += f"[{report.when}] {report.longreprtext}\n"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps(self.results, indent=1), encoding="utf-8")
