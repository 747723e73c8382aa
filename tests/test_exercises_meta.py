"""The exercises are real: each one's graded tests fail when only it is stubbed and pass on the solution,
a fully stubbed tree still imports with the same signatures, and READMEs, markers and tests agree.

The per-exercise check runs once for all exercises: a *toggle tree* keeps every solution behind an
``if is_stubbed("chNN.k"): raise NotImplementedError(...)``, and the pytest plugin stubs each graded
test's own exercise while it runs (``EXERCISES_STUB=own``). One subprocess instead of one per exercise.
The course's order (``exercises/course.py``) is checked the same way: ``EXERCISES_STUB=around`` solves
a graded test's exercise and what it needs, and stubs every other exercise of its chapter and later.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from chapters import CHAPTERS
from exercises.__main__ import main as exercises_main
from exercises.course import COURSE, STEPS
from exercises.grading import BLOCKED, NOT_ATTEMPTED, PASSED, grade, run_graded_tests
from exercises.key import solution_diff
from exercises.markers import STUB_ID_IN_TEXT, MarkerError, discover, function_at, functions_of, parse_file, rewrite_file
from exercises.tree import repository_root, student_tree, write_tree
from shared.unwritten import or_meanwhile

ROOT = repository_root()
TESTS = ROOT / "tests"
EXERCISES = discover(ROOT)
# What a graded run needs from the repository (the tests' conftest imports benchmarks and shared).
TREE_PARTS = ["chapters", "shared", "benchmarks", "exercises", "tests", "pyproject.toml"]
README_ENTRY = re.compile(r'<a id="exercise-(\d+)"></a>\s*(ch\d{2}\.\d+)\b')
GRADED_MARK = re.compile(r'exercise\(\s*"(ch\d{2}\.\d+)"')


def test_there_are_exercises_in_every_chapter_with_markers() -> None:
    per_chapter = Counter(e.chapter for e in EXERCISES)
    # Every chapter teaches at least three pieces a learner writes.
    assert {chapter: per_chapter[chapter] for chapter in CHAPTERS if per_chapter[chapter] < 3} == {}
    for exercise in EXERCISES:
        assert exercise.title and exercise.regions


def test_every_marked_exercise_has_a_readme_entry_and_every_entry_a_marker() -> None:
    listed: dict[str, str] = {}
    for readme_path in sorted((ROOT / "chapters").glob("ch*/README.md")):
        folder = readme_path.parent.name
        readme = readme_path.read_text(encoding="utf-8")
        for anchor, exercise_id in README_ENTRY.findall(readme):
            assert exercise_id.startswith(folder[:4]), f"{folder}/README.md lists {exercise_id}"
            assert anchor == exercise_id.split(".")[1], f"{exercise_id} is anchored #exercise-{anchor}"
            listed[exercise_id] = folder
    marked = {e.id for e in EXERCISES}
    assert sorted(marked - set(listed)) == [], "marked in the code but missing from its chapter README's Exercises"
    assert sorted(set(listed) - marked) == [], "listed in a README but marked nowhere in the code"


def test_every_marked_exercise_has_graded_tests_and_every_graded_test_an_exercise() -> None:
    graded = set()
    for path in sorted(TESTS.glob("test_exercises_ch*.py")):
        graded |= set(GRADED_MARK.findall(path.read_text(encoding="utf-8")))
    marked = {e.id for e in EXERCISES}
    assert sorted(marked - graded) == [], "exercises without a graded test in tests/test_exercises_chNN.py"
    assert sorted(graded - marked) == [], "graded tests of exercises that no marker defines"


@pytest.mark.slow  # make test-slow (stubs every exercise in turn); the course-order check runs on every run
def test_each_exercises_tests_fail_with_only_it_stubbed_naming_it(tmp_path: Path) -> None:
    tree = tmp_path / "toggle"
    write_tree(ROOT, tree, EXERCISES, toggle=True, only=TREE_PARTS)
    run = run_graded_tests(tree, EXERCISES, tests_dir=TESTS, stub="own")
    assert run.returncode in (0, 1), run.output[-3000:]
    problems = []
    for exercise in EXERCISES:
        mine = {nodeid: r for nodeid, r in run.results.items() if exercise.id in r["exercises"]}
        if not mine:
            problems.append(f"{exercise.id}: no graded test ran")
        for nodeid, result in mine.items():
            if result["outcome"] != "failed":
                problems.append(f"{exercise.id}: {nodeid} {result['outcome']} with the exercise stubbed")
            elif exercise.id not in STUB_ID_IN_TEXT.findall(result["text"]):
                problems.append(f"{exercise.id}: {nodeid} failed without naming {exercise.id}:\n{result['text'][-800:]}")
    assert problems == [], "\n".join(problems)


def test_the_course_plan_orders_every_exercise_once_after_what_it_needs() -> None:
    ids = [step.id for step in COURSE]
    assert sorted(ids) == sorted(e.id for e in EXERCISES) and len(set(ids)) == len(ids)
    assert [i.split(".")[0] for i in ids] == sorted(i.split(".")[0] for i in ids), "chapters in order"
    for index, step in enumerate(COURSE):
        for need in step.needs:
            assert need.split(".")[0] == step.id.split(".")[0] and ids.index(need) < index, (step.id, need)


def test_the_instructors_table_is_the_course_plan() -> None:
    rows = re.findall(r"^\| (ch\d{2}\.\d+) \| .+? \| (.+?) \| (\d+) min \|$", (ROOT / "exercises" / "README.md").read_text(), re.MULTILINE)
    assert [(i, tuple(a.split(", ")) if a != "—" else (), int(m)) for i, a, m in rows] == \
        [(step.id, step.needs, step.minutes) for step in COURSE]


def test_each_exercise_passes_in_the_courses_order_with_the_rest_of_its_chapter_and_later_stubbed(tmp_path: Path) -> None:
    tree = tmp_path / "toggle"
    write_tree(ROOT, tree, EXERCISES, toggle=True, only=TREE_PARTS)
    run = run_graded_tests(tree, EXERCISES, tests_dir=TESTS, stub="around")
    assert run.returncode in (0, 1), run.output[-3000:]
    problems = [f"{', '.join(r['exercises'])}: {nodeid} {r['outcome']} with only it and what it needs "
                f"({', '.join(sorted({n for i in r['exercises'] for n in STEPS[i].needs})) or 'nothing'}) solved in its chapter:\n"
                f"{r['text'][-600:]}"
                for nodeid, r in run.results.items() if r["outcome"] != "passed"]
    assert len(run.results) >= len(EXERCISES) and problems == [], "\n".join(problems)


@pytest.mark.slow  # the default suite runs every graded test on the solution already; this adds the grader's path
def test_the_grader_passes_every_exercise_of_the_solution(tmp_path: Path) -> None:
    junit = tmp_path / "results.xml"
    run = run_graded_tests(ROOT, EXERCISES, tests_dir=TESTS, junit=junit)
    grades = grade(EXERCISES, run)
    assert {g.exercise.id: g.status for g in grades} == {e.id: PASSED for e in EXERCISES}, run.output[-3000:]
    assert junit.read_text(encoding="utf-8").count("<testcase") == len(run.results)


SIGNATURES = textwrap.dedent(
    """
    import importlib, inspect, json, pkgutil, sys
    import chapters

    out, helps = {}, {}
    for info in pkgutil.walk_packages(chapters.__path__, "chapters."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                out[f"{info.name}.{name}"] = str(inspect.signature(obj))
            elif inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if inspect.isfunction(member) and (not attr.startswith("_") or attr == "__init__"):
                        out[f"{info.name}.{name}.{attr}"] = str(inspect.signature(member))
        if info.name.endswith(".server") and hasattr(module, "main"):
            try:
                module.main(["--help"])
            except SystemExit as exit:
                helps[info.name] = exit.code or 0
    json.dump({"signatures": out, "help": helps}, sys.stdout)
    """
)


def signatures_of(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", SIGNATURES], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout[done.stdout.index('{"signatures"'):])
    # A default value's repr may hold an address (a lambda) or the tree's path: not part of the signature.
    found["signatures"] = {name: re.sub(r" at 0x[0-9a-f]+", "", text).replace(str(tree), "<tree>") for name, text in found["signatures"].items()}
    return found


def test_a_fully_stubbed_tree_imports_starts_and_keeps_every_public_signature(tmp_path: Path) -> None:
    tree = tmp_path / "student-all"
    chosen, rewritten = student_tree(ROOT, tree, None, only=TREE_PARTS)
    assert {e.id for e in chosen} == {e.id for e in EXERCISES} and rewritten
    for relative in rewritten:
        text = (tree / relative).read_text(encoding="utf-8")
        for exercise in chosen:
            if any(region.path == relative for region in exercise.regions):
                assert f'raise NotImplementedError("{exercise.stub_message}")' in text
    solution_tree = tmp_path / "solution"  # a copy taken now, like the student tree: the same snapshot
    write_tree(ROOT, solution_tree, [], only=TREE_PARTS)
    stubbed, solution = signatures_of(tree), signatures_of(solution_tree)
    assert stubbed["signatures"] == solution["signatures"]
    assert {f"chapters.{folder}.server" for folder in CHAPTERS.values()} <= set(stubbed["help"]), stubbed["help"]
    assert set(stubbed["help"].values()) == {0}, "every chapter's command line still parses"
    started = subprocess.run([sys.executable, "-m", "chapters.ch02_fastapi_async", "--help"], cwd=tree,
                             env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0 and "--port" in started.stdout, started.stderr[-2000:]


def test_only_an_exercises_stub_gets_a_start_up_stand_in() -> None:
    """``or_meanwhile`` swaps in its stand-in for what a student tree's stub raises, and for nothing else."""
    for exercise in EXERCISES:
        def stub(message: str = exercise.stub_message) -> int:
            raise NotImplementedError(message)

        assert or_meanwhile(stub, lambda: 7, "seven") == 7, exercise.id

    def missing_kernel() -> int:
        raise NotImplementedError("Could not run 'aten::foo' with arguments from the 'QuantizedCPU' backend")

    with pytest.raises(NotImplementedError, match="aten::foo"):
        or_meanwhile(missing_kernel, lambda: 7, "seven")
    assert or_meanwhile(lambda: 3, lambda: 7, "seven") == 3


# Each chapter's start-up path (settings, model, pool, engine, batcher or scheduler, the app), up to
# the moment it would listen: uvicorn's Server.run is replaced by a marker. Chapter 1 builds its
# Flask app as each gunicorn worker does.
STARTS = textwrap.dedent(
    """
    import importlib, json, sys
    import uvicorn
    from chapters import CHAPTERS

    class Listening(Exception):
        pass

    def listen(self, *args, **kwargs):
        raise Listening

    uvicorn.Server.run = listen
    flags = ["--weights", "dummy", "--port", "0", "--log-level", "warning"]
    started = {}
    for chapter, folder in CHAPTERS.items():
        server = importlib.import_module(f"chapters.{folder}.server")
        try:
            if chapter == "ch01":
                server.build_app(server.parse_settings(server.FlaskSyncSettings, flags))
            else:
                server.main(flags)
            started[chapter] = "returned without listening"
        except Listening:
            started[chapter] = "listening"
        except BaseException as exc:
            started[chapter] = f"{type(exc).__name__}: {exc}"
        if chapter == "ch01":
            started[chapter] = started[chapter].replace("returned without listening", "listening")
    json.dump(started, sys.stdout)
    """
)


def test_every_chapter_starts_in_a_fully_stubbed_tree(tmp_path: Path) -> None:
    """``student --all``: a stub on a start-up path has a stand-in (``shared/unwritten.py``), so every chapter starts."""
    tree = tmp_path / "student-all"
    student_tree(ROOT, tree, None, only=TREE_PARTS)
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "SFS_ENGINE_CACHE": str(tmp_path / "engines")}
    done = subprocess.run([sys.executable, "-c", STARTS], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    started = json.loads(done.stdout[done.stdout.index("{"):])
    assert started == {chapter: "listening" for chapter in CHAPTERS}, started


def test_a_chapter_3_student_tree_grades_its_exercises_as_not_attempted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The instructor's path, by the command line: hand out chapter 3, then grade the untouched tree."""
    tree = tmp_path / "student-ch03"
    assert exercises_main(["student", "--chapter", "ch03", "--out", str(tree)]) == 0
    assert (tree / "README.md").exists() and (tree / "shared" / "weights").is_dir(), "a whole repository"
    chapter3 = [e for e in EXERCISES if e.chapter == "ch03"]
    for exercise in chapter3:
        for region in exercise.regions:
            assert exercise.stub_message in (tree / region.path).read_text(encoding="utf-8")
    junit = tmp_path / "ch03.xml"
    capsys.readouterr()
    assert exercises_main(["grade", "--tree", str(tree), "--chapter", "ch03", "--junit", str(junit)]) == 1
    table = capsys.readouterr().out
    # The first exercise hits its own stub; a later one may stop at an earlier one's stub first.
    assert re.search(rf"^ch03\.1\s+{NOT_ATTEMPTED}\b", table, re.MULTILINE), table
    for exercise in chapter3:
        assert re.search(rf"^{re.escape(exercise.id)}\s+({NOT_ATTEMPTED}|{BLOCKED})\b", table, re.MULTILINE), table
    assert junit.exists() and "ch03.1" in junit.read_text(encoding="utf-8")


CHECK_LINE = re.compile(r"\*\*Check:\*\* `(pytest -m (ch\d{2}_\d+))`")


@pytest.mark.slow
def test_a_learners_check_line_grades_the_tree_it_stands_in_unsolved_then_solved(tmp_path: Path) -> None:
    """The README's "Check:" line, run as written with bare ``pytest`` inside a student tree, while this
    environment's editable install points at the solved repository: it must grade the student's code."""
    checks = dict((marker, line) for line, marker in CHECK_LINE.findall(
        (ROOT / "chapters" / "ch03_dynamic_batching" / "README.md").read_text(encoding="utf-8")))
    exercise = next(e for e in EXERCISES if e.id == "ch03.1")
    command = checks[exercise.id.replace(".", "_")].split()
    tree = tmp_path / "student-ch03"
    assert exercises_main(["student", "--chapter", "ch03", "--out", str(tree)]) == 0
    pytest_command = [str(Path(sys.executable).with_name("pytest")), *command[1:], "-p", "no:cacheprovider"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EXERCISES_TREE")}
    unsolved = subprocess.run(pytest_command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert unsolved.returncode == 1 and exercise.stub_message in unsolved.stdout, unsolved.stdout[-3000:]
    summary = unsolved.stdout.split("short test summary info")[-1]  # the end of the run names what failed
    assert "INTERNALERROR" not in unsolved.stdout and "FAILED tests/test_exercises_ch03.py::" in summary, unsolved.stdout[-3000:]
    for region in exercise.regions:  # the learner writes the solution
        (tree / region.path).write_text((ROOT / region.path).read_text(encoding="utf-8"), encoding="utf-8")
    solved = subprocess.run(pytest_command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert solved.returncode == 0 and " passed" in solved.stdout, solved.stdout[-3000:]


def test_the_grader_refuses_a_tree_whose_code_is_not_what_gets_imported(tmp_path: Path) -> None:
    """EXERCISES_TREE names a tree, but the code comes from elsewhere: stop instead of grading the wrong code."""
    tree = tmp_path / "elsewhere"
    (tree / "chapters").mkdir(parents=True)
    env = {**os.environ, "EXERCISES_TREE": str(tree)}
    done = subprocess.run([sys.executable, "-m", "pytest", str(TESTS / "test_exercises_ch04.py"), "-q", "-p", "no:cacheprovider",
                           "-m", "ch04_3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4 and "was imported from" in done.stdout + done.stderr, done.stdout[-2000:]


def test_student_refuses_to_write_inside_the_repository_or_an_unknown_chapter(tmp_path: Path) -> None:
    assert exercises_main(["student", "--chapter", "ch03", "--out", str(ROOT / "student-inside")]) == 2
    assert not (ROOT / "student-inside").exists()
    assert exercises_main(["student", "--chapter", "ch99", "--out", str(tmp_path / "x")]) == 2


def _chapter_file(root: Path, source: str, name: str = "m.py") -> Path:
    path = root / "chapters" / "ch03_x" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(source.encode("utf-8"))
    return path


@pytest.mark.parametrize(
    ("source", "complaint"),
    [
        # A BEGIN without END runs to the end of its function, so it must not stop inside a block of it.
        ('def f(x):\n    if x:\n        # EXERCISE ch03.9 BEGIN "t"\n        return 1\n    return 2\n', "ch03.9 has no END"),
        ('def f():\n    return 1\n    # EXERCISE ch03.9 END\n', "without its BEGIN"),
        ('def f():\n    # EXERCISE ch03.9 BEGIN "t"\n    return 1\n# EXERCISE ch03.9 END\n', "without its BEGIN .*ran to the end of f"),
        ('def f():\n    # EXERCISE ch03.9 BEGIN "t"\n    a = 1\n    # EXERCISE ch03.8 END\n', "END of ch03.8 without its BEGIN"),
        ('# EXERCISE ch03.9 BEGIN "t"\nX = 1\n# EXERCISE ch03.9 END\n', "inside a function body"),
        ('X = 1\n# EXERCISE ch03.9 BEGIN "t"\nY = 2\n', "inside a function body"),  # unclosed, at module level
        ('def f():\n    return 1\n# EXERCISE ch03.9 BEGIN "t"\nX = 1\n', "inside a function body"),
        # Two regions in one function: the first needs its END.
        ('def f():\n    # EXERCISE ch03.9 BEGIN "t"\n    a = 1\n    # EXERCISE ch03.8 BEGIN "u"\n    return a\n',
         "ch03.8 begins inside ch03.9 .*needs its END before it"),
        ('def f():\n    # EXERCISE ch03.9 BEGIN "t"\n    a = 1\n    # EXERCISE ch03.8 BEGIN "u"\n    b = 2\n'
         '    # EXERCISE ch03.8 END\n    return a\n    # EXERCISE ch03.9 END\n', "begins inside"),
        ('def f():\n    return 1\n    # EXERCISE ch03.9 BEGIN "t"\n', "marks no lines"),
        ('def f():\n    x = 1\n    # EXERCISE ch03.9 BEGIN "t"\n    # only a comment\n    # EXERCISE ch03.9 END\n    return x\n', "only comments"),
        ('def f():\n  # EXERCISE ch03.9 BEGIN "t"\n    return 1\n  # EXERCISE ch03.9 END\n', "indented like"),
        ('def f():\n    # EXERCISE ch03.9 BEGIN t\n    return 1\n', "malformed"),
    ],
)
def test_bad_markers_are_errors_not_silent_misses(tmp_path: Path, source: str, complaint: str) -> None:
    path = _chapter_file(tmp_path, source)
    with pytest.raises(MarkerError, match=complaint):
        parse_file(tmp_path, path)


# A region without END (ch03.9: it runs to the end of take, trailing comment included), then in one
# function a region with END followed by one without (ch03.8), the last one inside a block, at the end
# of the file.
OPEN_ENDED = '''\
class Pool:
    def take(self, n: int) -> int:
        """Take n."""
        if n < 0:
            raise ValueError(n)
        # EXERCISE ch03.9 BEGIN "take them"
        self.used += n
        return self.used
        # a trailing comment of the solution

    def give(self, n: int) -> None:
        # EXERCISE ch03.8 BEGIN "give them"
        self.used -= n
        # EXERCISE ch03.8 END
        self.check()
        if n:
            # EXERCISE ch03.8 BEGIN "give them"
            if self.used == 0:
                self.idle = True
'''
STUB_9 = 'raise NotImplementedError("ch03.9: take them, see chapters/ch03_x/README.md#exercise-9")'
STUB_8 = 'raise NotImplementedError("ch03.8: give them, see chapters/ch03_x/README.md#exercise-8")'
OPEN_ENDED_STUB = f'''\
class Pool:
    def take(self, n: int) -> int:
        """Take n."""
        if n < 0:
            raise ValueError(n)
        # EXERCISE ch03.9 BEGIN "take them"
        {STUB_9}

    def give(self, n: int) -> None:
        # EXERCISE ch03.8 BEGIN "give them"
        {STUB_8}
        # EXERCISE ch03.8 END
        self.check()
        if n:
            # EXERCISE ch03.8 BEGIN "give them"
            {STUB_8}
'''


def _without_toggle_guards(text: str) -> str:
    """A toggle tree's file minus the two lines put in front of each region: the solution's own text."""
    lines = text.splitlines(keepends=True)
    kept, index = [], 0
    while index < len(lines):
        if lines[index].lstrip().startswith('if __import__("exercises.toggle").toggle.is_stubbed('):
            assert lines[index + 1].lstrip().startswith("raise NotImplementedError("), lines[index + 1]
            index += 2
            continue
        kept.append(lines[index])
        index += 1
    return "".join(kept)


def test_a_region_without_end_runs_to_the_end_of_its_function(tmp_path: Path) -> None:
    path = _chapter_file(tmp_path, OPEN_ENDED)
    regions = [(i, r.begin, r.end, r.has_end, r.indent, r.function) for i, _, r in parse_file(tmp_path, path)]
    assert regions == [
        ("ch03.9", 5, 9, False, " " * 8, "Pool.take"),  # through the trailing comment, not the blank line after it
        ("ch03.8", 11, 13, True, " " * 8, "Pool.give"),
        ("ch03.8", 16, 19, False, " " * 12, "Pool.give"),
    ]
    # With an END after the return, as before: the same lines, marked the other way.
    explicit = OPEN_ENDED.replace("        # a trailing comment of the solution\n",
                                  "        # a trailing comment of the solution\n        # EXERCISE ch03.9 END\n")
    first = parse_file(tmp_path, _chapter_file(tmp_path, explicit, "e.py"))[0][2]
    assert (first.begin, first.end, first.has_end, first.function) == (5, 9, True, "Pool.take")


def test_a_region_without_end_stubs_to_its_begin_and_the_raise_and_restubs_to_the_same(tmp_path: Path) -> None:
    _chapter_file(tmp_path, OPEN_ENDED)
    relative = Path("chapters/ch03_x/m.py")
    stub = rewrite_file(tmp_path, relative, discover(tmp_path))
    assert stub == OPEN_ENDED_STUB
    again = tmp_path / "again"
    _chapter_file(again, stub)
    found = discover(again)
    assert [(r.begin, r.end, r.has_end) for e in found for r in e.regions] == [(9, 11, True), (14, 16, False), (5, 7, False)]
    assert rewrite_file(again, relative, found) == stub  # a stubbed tree stubbed again: unchanged


def test_a_region_without_end_toggles_and_keys_back_to_the_original_byte_for_byte(tmp_path: Path) -> None:
    _chapter_file(tmp_path, OPEN_ENDED)
    relative = Path("chapters/ch03_x/m.py")
    exercises = discover(tmp_path)
    toggled = rewrite_file(tmp_path, relative, exercises, toggle=True)
    assert _without_toggle_guards(toggled) == OPEN_ENDED
    namespace: dict = {}
    exec(compile(toggled, "m.py", "exec"), namespace)  # the guard is inside the function, before the solution
    pool = namespace["Pool"]()
    pool.used = 1
    assert pool.take(2) == 3
    for exercise in exercises:  # the answer key turns the stub back into the solution
        learner = tmp_path / f"learner-{exercise.id}"
        _chapter_file(learner, rewrite_file(tmp_path, relative, [exercise]))
        key = tmp_path / f"{exercise.id}.diff"
        key.write_text(solution_diff(tmp_path, exercise), encoding="utf-8")
        done = subprocess.run(["git", "apply", str(key)], cwd=learner, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (learner / relative).read_bytes() == OPEN_ENDED.encode("utf-8")


def test_a_region_without_end_at_the_end_of_a_file_without_newline(tmp_path: Path) -> None:
    source = 'def f(x):\n    """Doc."""\n    # EXERCISE ch03.9 BEGIN "t"\n    return x + 1'
    _chapter_file(tmp_path, source)
    relative = Path("chapters/ch03_x/m.py")
    exercises = discover(tmp_path)
    stub = rewrite_file(tmp_path, relative, exercises)
    assert stub == source.replace("return x + 1", 'raise NotImplementedError("ch03.9: t, see chapters/ch03_x/README.md#exercise-9")')
    assert _without_toggle_guards(rewrite_file(tmp_path, relative, exercises, toggle=True)) == source
    again = tmp_path / "again"
    _chapter_file(again, stub)
    assert rewrite_file(again, relative, discover(again)) == stub


def test_every_marked_file_stubs_restubs_and_toggles_back_byte_for_byte(tmp_path: Path) -> None:
    """This repository's markers, either form: a stubbed region is its BEGIN, the raise and its END if it has
    one; stubbing again changes nothing; a toggle tree without its guards is the solution."""
    snapshot = tmp_path / "solution"  # chapters/ is being edited: one snapshot for every step
    write_tree(ROOT, snapshot, [], only=["chapters"])
    exercises = discover(snapshot)
    student = tmp_path / "student"
    write_tree(snapshot, student, exercises, only=["chapters"])
    toggled = tmp_path / "toggle"
    rewritten = write_tree(snapshot, toggled, exercises, toggle=True, only=["chapters"])
    assert rewritten
    restubbed = discover(student)
    assert [(e.id, len(e.regions)) for e in restubbed] == [(e.id, len(e.regions)) for e in exercises]
    for exercise in restubbed:
        for region in exercise.regions:
            lines = (student / region.path).read_text(encoding="utf-8").splitlines()
            assert lines[region.begin + 1 : region.end] == [f'{region.indent}raise NotImplementedError("{exercise.stub_message}")'], \
                f"{region.path}:{region.begin + 1}"
    for relative in rewritten:
        assert rewrite_file(student, relative, restubbed) == (student / relative).read_text(encoding="utf-8"), relative
        assert _without_toggle_guards((toggled / relative).read_text(encoding="utf-8")) == \
            (snapshot / relative).read_text(encoding="utf-8"), relative


def test_no_END_marker_lingers_after_the_return_that_ends_its_function() -> None:
    """An END right after a function's final ``return`` (or ``raise``) reads as misplaced dead code: a region
    that runs to the end of its function has none."""
    lingering = []
    for exercise in EXERCISES:
        for region in exercise.regions:
            if not region.has_end:
                continue
            text = (ROOT / region.path).read_text(encoding="utf-8")
            lines = text.splitlines()
            function = function_at(functions_of(ast.parse(text), lines), region.end)
            if function is None or function.last != region.end:
                continue  # the region stops before its function's end: its END is needed
            previous = max(i for i in range(region.begin + 1, region.end) if lines[i].strip())
            exits = [node for node in ast.walk(function.node)
                     if isinstance(node, (ast.Return, ast.Raise)) and (node.end_lineno or 0) - 1 == previous]
            if exits:
                lingering.append(f"{region.path}:{region.end + 1}: {exercise.id} END after the {type(exits[0]).__name__.lower()} "
                                 f"that ends {function.name}")
    assert lingering == [], ("END markers after the return/raise that ends their function (drop them: the region then runs "
                             "to the function's end):\n" + "\n".join(lingering))
