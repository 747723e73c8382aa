"""Copies of the repository: the student tree (regions stubbed) and the meta-test's toggle tree."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from exercises.markers import Exercise, discover, rewrite_file, select

# Never copied when the source is not a git checkout (in a checkout, git's ignore rules decide).
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "build", ".cache", "results"}
SKIPPED_SUFFIXES = (".pyc", ".egg-info")


def repository_root() -> Path:
    """The repository this package belongs to (the solution tree, for an instructor)."""
    return Path(__file__).resolve().parent.parent


def repository_files(root: Path) -> list[Path]:
    """Files of the repository at ``root``, relative: what git tracks or would track (untracked, not ignored)."""
    root = Path(root)
    if (root / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root, check=True, capture_output=True, text=True,
        ).stdout
        return sorted(Path(name) for name in set(listed.split("\0")) if name and (root / name).is_file())
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.endswith(SKIPPED_SUFFIXES))
        for name in names:
            if not name.endswith(SKIPPED_SUFFIXES):
                files.append((Path(directory) / name).relative_to(root))
    return sorted(files)


def write_tree(
    source: Path,
    out: Path,
    exercises: Iterable[Exercise],
    *,
    toggle: bool = False,
    only: Iterable[str] | None = None,
) -> list[Path]:
    """Copy the repository at ``source`` to ``out`` with the regions of ``exercises`` rewritten.

    ``only``: copy just these top-level entries (files or folders) instead of the whole repository,
    for quick trees in tests. ``out`` must not exist or be empty, and must not lie inside ``source``.
    Returns the files that were rewritten (relative paths).
    """
    source, out = Path(source).resolve(), Path(out).resolve()
    if out == source or source in out.parents:
        raise ValueError(f"the student tree {out} must lie outside the repository {source}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose another --out or remove it")
    exercises = list(exercises)
    rewritten = sorted({region.path for exercise in exercises for region in exercise.regions})
    keep = None if only is None else set(only)
    for relative in repository_files(source):
        if keep is not None and relative.parts[0] not in keep:
            continue
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if relative not in rewritten:
            shutil.copy2(source / relative, target)
    for relative in rewritten:
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rewrite_file(source, relative, exercises, toggle=toggle), encoding="utf-8")
    return rewritten


def student_tree(source: Path, out: Path, chapters: Iterable[str] | None = None, **kwargs) -> tuple[list[Exercise], list[Path]]:
    """The learner's copy: every exercise of ``chapters`` (all when None) stubbed."""
    chosen = select(discover(source), chapters)
    return chosen, write_tree(source, out, chosen, **kwargs)
