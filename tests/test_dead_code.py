"""No dead definitions in ``chapters/`` and ``shared/``: every top-level function, class and constant, and every
method of a class that overrides nothing, is used by the project's own code somewhere.

"Used" means its name appears in another file of :data:`USERS` (the chapters, the shared library, the
benchmarks, the exercises' tooling, the notebooks, the scripts, the Makefile, the packaging), or more than once in
its own file. The tests do not count: a definition only a test calls is dead code with a test. Decorated
definitions (validators, routes, fixtures) and methods of a class with bases (a framework's hooks) are called by
what they are registered with, so they are not judged.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from shared.paths import REPO_ROOT

JUDGED = ("chapters", "shared")
USERS = ("chapters", "shared", "benchmarks", "exercises", "notebooks", "scripts")
USER_FILES = ("Makefile", "pyproject.toml")
SUFFIXES = {".py", ".ipynb", ".sh", ".js", ".html", ".yaml", ".toml", ".c"}
ALWAYS_USED = {"main", "log", "app"}  # entry points and module loggers
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def source_files() -> list[Path]:
    files = [p for folder in USERS for p in (REPO_ROOT / folder).rglob("*")
             if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return files + [REPO_ROOT / name for name in USER_FILES]


def definitions(tree: ast.Module) -> list[str]:
    """The names a module defines at its top level, and the methods of its classes that override nothing."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.decorator_list:
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        if isinstance(node, ast.ClassDef) and not node.bases:
            names += [item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and not item.decorator_list and not item.name.startswith("__")]
    return [name for name in names if name not in ALWAYS_USED and not name.startswith("__")]


def dead_definitions(root: Path = REPO_ROOT) -> list[str]:
    counts = {path: Counter(WORD.findall(path.read_text(encoding="utf-8", errors="ignore"))) for path in source_files()}
    users: dict[str, int] = Counter()
    for counted in counts.values():
        users.update(counted.keys())
    dead = []
    for path, counted in counts.items():
        if path.suffix != ".py" or path.relative_to(root).parts[0] not in JUDGED:
            continue
        for name in definitions(ast.parse(path.read_text(encoding="utf-8"))):
            if users[name] - 1 == 0 and counted[name] <= 1:  # no other file names it; its own file only defines it
                dead.append(f"{path.relative_to(root)}: {name}")
    return sorted(dead)


def test_the_scan_finds_a_definition_nobody_uses() -> None:
    tree = ast.parse("X = 1\n\ndef used():\n    return X\n\nclass Plain:\n    def hook(self):\n        pass\n\n"
                     "class Hooked(Base):\n    def hook(self):\n        pass\n")
    assert definitions(tree) == ["X", "used", "Plain", "hook", "Hooked"]


def test_no_definition_in_the_chapters_or_the_shared_library_is_dead() -> None:
    assert dead_definitions() == []
