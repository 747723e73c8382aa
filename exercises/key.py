"""The answer key: for each exercise, the diff that turns its stub into the solution.

An instructor hands ``chNN.k.diff`` out after the deadline; it applies to a student tree with
``git apply`` (or ``patch -p1``) and touches nothing but that exercise's regions.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from exercises.markers import Exercise, rewrite_file


def solution_diff(root: Path, exercise: Exercise) -> str:
    """A unified diff, per file holding ``exercise``'s regions, from its stub to its solution."""
    parts = []
    for relative in sorted({region.path for region in exercise.regions}):
        solution = (Path(root) / relative).read_text(encoding="utf-8")
        stub = rewrite_file(root, relative, [exercise])
        parts.extend(difflib.unified_diff(
            stub.splitlines(keepends=True), solution.splitlines(keepends=True),
            fromfile=f"a/{relative.as_posix()}", tofile=f"b/{relative.as_posix()}",
        ))
    return "".join(parts)


def write_key(root: Path, exercises: list[Exercise], out: Path) -> list[Path]:
    """``out/<id>.diff`` for each exercise; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for exercise in exercises:
        path = out / f"{exercise.id}.diff"
        path.write_text(solution_diff(root, exercise), encoding="utf-8")
        written.append(path)
    return written
