"""Find the exercises marked in the chapters' code and rewrite their regions.

A region is the body lines of a function (or method) after a BEGIN comment line, up to the end of the
function::

    def window_s(self) -> float:
        \"\"\"The docstring stays.\"\"\"
        # EXERCISE ch06.1 BEGIN "the adaptive window rule"
        expected = ...
        return ...

or, when the region stops before the function's end, up to an END comment line, indented like its BEGIN::

        # EXERCISE ch06.2 BEGIN "the arrival rate"
        ...
        # EXERCISE ch06.2 END
        more of the function

A function's end is its last statement, or a comment after it still indented deeper than its ``def``
(:func:`functions_of`); an END there is allowed but needless. Two regions in one function: the first
needs its END. One exercise may have several regions (in one chapter), each BEGIN carrying the same
title. The student version of a region is a single ``raise NotImplementedError("ch06.1: <title>, see
chapters/<folder>/README.md#exercise-1")`` at the marker's indentation (for a region without END,
the function's last line); the marker lines stay, so a student tree can be stubbed again, graded, and
its exercises discovered by the same code.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

EXERCISE_ID = re.compile(r"^(ch\d{2})\.(\d+)$")
MARKER = re.compile(r'^(?P<indent>[ ]*)# EXERCISE (?P<id>ch\d{2}\.\d+) (?:BEGIN "(?P<title>[^"\\]+)"|(?P<end>END))[ ]*$')
# Anything that looks like an attempt at a marker, so a typo is an error instead of a silent miss.
MARKER_LIKE = re.compile(r"^\s*#\s*EXERCISE\b")
# The id inside a stub's NotImplementedError, as it shows in a traceback or in a wrapped message.
STUB_ID_IN_TEXT = re.compile(r"NotImplementedError(?::\s*|\(\s*['\"])(ch\d{2}\.\d+):")


class MarkerError(ValueError):
    """Markers that cannot be turned into a stub: unpaired, outside a function, bad indentation."""


@dataclass(frozen=True)
class Region:
    """The lines strictly between one BEGIN and its END, or from a BEGIN to the end of its function when
    it has no END (0-based indices into the file's lines)."""

    path: Path  # relative to the repository root
    begin: int  # index of the BEGIN line
    end: int  # index of the END line; without one (has_end False), the index just past the function's last line
    indent: str
    function: str  # qualified name of the function whose body holds the region
    has_end: bool = True  # False: no END marker, the region runs to the end of its function


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    folder: str  # chapters/<folder>
    regions: tuple[Region, ...]

    @property
    def chapter(self) -> str:
        return self.id.split(".")[0]

    @property
    def number(self) -> int:
        return int(self.id.split(".")[1])

    @property
    def marker_name(self) -> str:
        """The pytest marker that selects its graded tests: ``ch03.1`` -> ``ch03_1``."""
        return marker_name(self.id)

    @property
    def readme_link(self) -> str:
        return f"chapters/{self.folder}/README.md#exercise-{self.number}"

    @property
    def stub_message(self) -> str:
        return f"{self.id}: {self.title}, see {self.readme_link}"

    @property
    def functions(self) -> list[str]:
        """``file:function`` of every region, for tables and READMEs."""
        return [f"{region.path.as_posix()}:{region.function}" for region in self.regions]


def marker_name(exercise_id: str) -> str:
    return exercise_id.replace(".", "_")


def check_id(exercise_id: str) -> str:
    if not EXERCISE_ID.match(exercise_id):
        raise ValueError(f"not an exercise id: {exercise_id!r} (expected chNN.k, e.g. ch03.1)")
    return exercise_id


def chapter_files(root: Path) -> list[Path]:
    """Every Python file under ``root/chapters``, in a stable order."""
    return sorted(path for path in (root / "chapters").rglob("*.py") if "__pycache__" not in path.parts)


def _enclosing_function(tree: ast.Module, first_line: int, last_line: int) -> str | None:
    """Qualified name of the innermost function whose body contains lines first..last (1-based)."""
    found: str | None = None

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                body_start = child.body[0].lineno
                if body_start <= first_line and last_line <= (child.end_lineno or 0):
                    if not isinstance(child, ast.ClassDef):
                        found = name
                    visit(child, f"{name}.")
                    continue
            visit(child, prefix)

    visit(tree, "")
    return found


@dataclass(frozen=True)
class Function:
    """A function (or method) of a file and the lines it spans (0-based indices into the file's lines)."""

    name: str  # qualified: Class.method, outer.inner
    first: int  # the ``def`` line
    last: int  # its body's last line: its last statement's, or a comment after it indented deeper than the ``def``
    node: ast.FunctionDef | ast.AsyncFunctionDef


def _indent_width(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def functions_of(tree: ast.Module, lines: list[str]) -> list[Function]:
    """Every function of a parsed file, outer before inner, with its extent.

    A function's body ends at its last statement (the AST's ``end_lineno``), or at the last comment line
    after it that is still indented deeper than its ``def`` (a trailing comment, or an END marker)."""
    found: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    last = (child.end_lineno or child.lineno) - 1
                    for index in range(last + 1, len(lines)):
                        stripped = lines[index].strip()
                        if not stripped:
                            continue
                        if not stripped.startswith("#") or _indent_width(lines[index]) <= child.col_offset:
                            break
                        last = index
                    found.append(Function(name, child.lineno - 1, last, child))
                visit(child, f"{name}.")
                continue
            visit(child, prefix)

    visit(tree, "")
    return found


def function_at(functions: list[Function], index: int) -> Function | None:
    """The innermost function whose body holds line ``index`` (after its ``def`` line, up to its last line)."""
    holding = [f for f in functions if f.first < index <= f.last]
    return max(holding, key=lambda f: f.first, default=None)


@dataclass
class _Open:
    id: str
    title: str
    begin: int
    indent: str
    function: Function


def parse_source(text: str, relative: Path) -> list[tuple[str, str, Region]]:
    """(id, title, region) for every marked region of one file's text; raise :class:`MarkerError` on bad markers.

    A BEGIN is closed by its END, or, when no END comes before its function's body ends, by the end of
    that function: the region runs to the function's last line. A region that stops earlier needs its END.
    """
    lines = text.splitlines()
    markers: list[tuple[int, re.Match[str]]] = []
    for index, line in enumerate(lines):
        match = MARKER.match(line)
        if match is None:
            if MARKER_LIKE.match(line):
                raise MarkerError(f'{relative}:{index + 1}: malformed marker (expected # EXERCISE chNN.k BEGIN "title" / END): {line.strip()}')
            continue
        markers.append((index, match))
    if not markers:
        return []
    tree = ast.parse(text, filename=str(relative))
    functions = functions_of(tree, lines)
    spans: list[tuple[str, str, int, int, str, bool]] = []  # id, title, begin, end, indent, has_end
    open_marker: _Open | None = None
    last_open_ended: _Open | None = None

    def close_at_function_end(region: _Open) -> None:
        nonlocal last_open_ended
        function = region.function
        for index in range(region.begin + 1, function.last + 1):
            if lines[index].strip() and _indent_width(lines[index]) < len(region.indent):
                raise MarkerError(
                    f"{relative}:{region.begin + 1}: {region.id} has no END, and its function {function.name} goes on after "
                    f"its block (line {index + 1}): put its END where the region stops"
                )
        spans.append((region.id, region.title, region.begin, function.last + 1, region.indent, False))
        last_open_ended = region

    for index, match in markers:
        exercise_id, indent = match["id"], match["indent"]
        if open_marker is not None and index > open_marker.function.last:
            close_at_function_end(open_marker)  # its function ended before this marker: the region ran to its end
            open_marker = None
        if match["end"] is None:
            if open_marker is not None:
                raise MarkerError(
                    f"{relative}:{index + 1}: {exercise_id} begins inside {open_marker.id} (begun at line {open_marker.begin + 1}): regions do not "
                    f"nest, and a region that another follows in its function ({open_marker.function.name}) needs its END before it"
                )
            function = function_at(functions, index)
            if function is None:
                raise MarkerError(f"{relative}:{index + 1}: {exercise_id} must mark lines inside a function body (its BEGIN is outside any function)")
            open_marker = _Open(exercise_id, match["title"].strip(), index, indent, function)
            continue
        if open_marker is None or open_marker.id != exercise_id:
            hint = ""
            if open_marker is not None:
                hint = f" (it is inside {open_marker.id}, begun at line {open_marker.begin + 1})"
            elif last_open_ended is not None and last_open_ended.id == exercise_id:
                hint = (f" (the region begun at line {last_open_ended.begin + 1} ran to the end of {last_open_ended.function.name}, "
                        f"line {last_open_ended.function.last + 1}: an END belongs inside the function, indented like its BEGIN)")
            raise MarkerError(f"{relative}:{index + 1}: END of {exercise_id} without its BEGIN{hint}")
        if indent != open_marker.indent:
            raise MarkerError(f"{relative}:{index + 1}: END of {exercise_id} is not indented like its BEGIN")
        spans.append((exercise_id, open_marker.title, open_marker.begin, index, indent, True))
        open_marker = None
    if open_marker is not None:
        close_at_function_end(open_marker)

    found: list[tuple[str, str, Region]] = []
    for exercise_id, title, begin, end, indent, has_end in spans:
        body = [line for line in lines[begin + 1 : end] if line.strip()]
        if not body:
            raise MarkerError(f"{relative}:{begin + 1}: {exercise_id} marks no lines")
        first_indent = len(body[0]) - len(body[0].lstrip(" "))
        if first_indent != len(indent):
            raise MarkerError(f"{relative}:{begin + 1}: the markers of {exercise_id} must be indented like the first line they enclose")
        code = [i for i in range(begin + 1, end) if lines[i].strip() and not lines[i].lstrip().startswith("#")]
        if not code:
            raise MarkerError(f"{relative}:{begin + 1}: {exercise_id} marks only comments")
        function_name = _enclosing_function(tree, code[0] + 1, code[-1] + 1)
        if function_name is None:
            raise MarkerError(f"{relative}:{begin + 1}: {exercise_id} must mark lines inside a function body")
        found.append((exercise_id, title, Region(relative, begin, end, indent, function_name, has_end)))
    return found


def parse_file(root: Path, path: Path) -> list[tuple[str, str, Region]]:
    """(id, title, region) for every marked region of one file; raise :class:`MarkerError` on bad markers."""
    return parse_source(path.read_text(encoding="utf-8"), path.relative_to(root))


def discover(root: Path) -> list[Exercise]:
    """Every exercise marked under ``root/chapters``, ordered by chapter then number."""
    root = Path(root)
    regions: dict[str, list[Region]] = {}
    titles: dict[str, str] = {}
    folders: dict[str, str] = {}
    for path in chapter_files(root):
        for exercise_id, title, region in parse_file(root, path):
            chapter = exercise_id.split(".")[0]
            folder = region.path.parts[1]
            if not folder.startswith(f"{chapter}_"):
                raise MarkerError(f"{region.path}:{region.begin + 1}: {exercise_id} is marked outside chapters/{chapter}_*")
            if titles.setdefault(exercise_id, title) != title:
                raise MarkerError(f"{region.path}:{region.begin + 1}: {exercise_id} is titled {title!r} here and {titles[exercise_id]!r} elsewhere")
            folders[exercise_id] = folder
            regions.setdefault(exercise_id, []).append(region)
    exercises = [Exercise(i, titles[i], folders[i], tuple(regions[i])) for i in regions]
    return sorted(exercises, key=lambda e: (e.chapter, e.number))


def select(exercises: Iterable[Exercise], chapters: Iterable[str] | None = None, ids: Iterable[str] | None = None) -> list[Exercise]:
    """The exercises of ``chapters`` (``ch03``) and/or with ``ids``; everything when both are None."""
    exercises = list(exercises)
    chapters = None if chapters is None else set(chapters)
    ids = None if ids is None else {check_id(i) for i in ids}
    known_chapters = {e.chapter for e in exercises}
    for chapter in chapters or ():
        if chapter not in known_chapters:
            raise ValueError(f"no exercises are marked in {chapter}; chapters with exercises: {', '.join(sorted(known_chapters)) or 'none'}")
    for exercise_id in ids or ():
        if exercise_id not in {e.id for e in exercises}:
            raise ValueError(f"no exercise {exercise_id} is marked in the chapters")
    return [
        e for e in exercises
        if (chapters is None or e.chapter in chapters) and (ids is None or e.id in ids)
    ]


def _python_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Python string literal


def rewrite(source: str, regions: dict[int, tuple[Exercise, Region]], *, toggle: bool = False) -> str:
    """``source`` with the regions beginning at the given line indices replaced.

    ``toggle=False``: the region's lines become the stub's ``raise``. ``toggle=True`` (for the
    meta-test): the lines stay, preceded by a ``raise`` that fires only while
    :func:`exercises.toggle.is_stubbed` says so, which lets one tree stand for "only this one stubbed".
    """
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    index = 0
    while index < len(lines):
        out.append(lines[index])
        if index not in regions:
            index += 1
            continue
        exercise, region = regions[index]
        raise_line = f"raise NotImplementedError({_python_string(exercise.stub_message)})\n"
        if toggle:
            out.append(f'{region.indent}if __import__("exercises.toggle").toggle.is_stubbed({_python_string(exercise.id)}):\n')
            out.append(f"{region.indent}    {raise_line}")
            out.extend(lines[region.begin + 1 : region.end])
        else:
            if not region.has_end and region.end == len(lines) and not lines[-1].endswith(("\n", "\r")):
                raise_line = raise_line[:-1]  # the function ends the file without a newline: so does its stub
            out.append(f"{region.indent}{raise_line}")
        if region.has_end:
            out.append(lines[region.end])  # the END marker
            index = region.end + 1
        else:
            index = region.end  # the region ran to the end of its function: nothing of it follows the stub
    return "".join(out)


def rewrite_file(root: Path, relative: Path, exercises: Iterable[Exercise], *, toggle: bool = False) -> str:
    """The text of ``root/relative`` with the regions of ``exercises`` in that file rewritten; checked to compile."""
    by_line = {region.begin: (exercise, region) for exercise in exercises for region in exercise.regions if region.path == relative}
    source = (root / relative).read_text(encoding="utf-8")
    rewritten = rewrite(source, by_line, toggle=toggle)
    compile(rewritten, str(relative), "exec")  # a region cut mid-statement fails here, not in the learner's hands
    return rewritten
