"""The chapters build on Ray's public API: no module under ``chapters/`` reaches into a ``ray.*._private`` module.

A private name is allowed only where the public API lacks it, and the line says so with a marker,
``# private: <name>[, <name>...] is not public in <public module>``. The marker is checked: it sits on a private use, it
names every name the line imports (and each is used), and none of them is public, neither in the module it names nor in
the ``__all__`` of any public module of that package; a name Ray makes public must then be imported from there.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.paths import REPO_ROOT

PRIVATE = re.compile(r"ray(\.\w+)*\._private(\.\w+)*")  # ray._private, ray.serve._private.router, ...
MARKER = re.compile(r"#\s*private:\s*(?P<names>\w+(?:\s*,\s*\w+)*)\s+(?:is|are)\s+not\s+public\s+in\s+(?P<public>[\w.]+)")


@dataclass(frozen=True)
class PrivateUse:
    """One statement or expression that reaches a private Ray module, and the marker on its lines (if any)."""

    line: int
    end_line: int
    module: str
    imported: tuple[str, ...]  # names a ``from ... import`` takes from it (submodules included)
    marker: re.Match | None = None


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def private_uses(source: str) -> list[PrivateUse]:
    """Every import of, attribute path into, or module-name string naming a private Ray module, with its marker."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            uses += [PrivateUse(node.lineno, node.end_lineno, a.name, ()) for a in node.names if PRIVATE.fullmatch(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if PRIVATE.fullmatch(node.module):
                uses.append(PrivateUse(node.lineno, node.end_lineno, node.module, tuple(a.name for a in node.names)))
            else:  # from ray.serve import _private
                uses += [PrivateUse(node.lineno, node.end_lineno, f"{node.module}.{a.name}", ()) for a in node.names
                         if PRIVATE.fullmatch(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted.startswith("ray.") and PRIVATE.match(dotted):
                uses.append(PrivateUse(node.lineno, node.end_lineno, dotted, ()))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE.fullmatch(node.value):
            uses.append(PrivateUse(node.lineno, node.end_lineno, node.value, ()))  # importlib.import_module("ray._private")
        for child in ast.iter_child_nodes(node):
            child.parent = node
    comments = {token.start[0]: token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}
    marked = []
    for use in uses:
        found = [m for line in range(use.line, use.end_line + 1) if (m := MARKER.search(comments.get(line, "")))]
        marked.append(PrivateUse(use.line, use.end_line, use.module, use.imported, found[0] if found else None))
    return sorted(marked, key=lambda use: use.line)


def stray_markers(source: str) -> list[int]:
    """Lines with a marker but no private use: an allowance nothing needs."""
    used = {line for use in private_uses(source) for line in range(use.line, use.end_line + 1)}
    return [token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and MARKER.search(token.string) and token.start[0] not in used]


def names_in(source: str) -> set[str]:
    """Identifiers a module uses (names, attributes, strings such as ``getattr``'s), import lines left out."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)
    return names


def chapter_modules() -> list[Path]:
    return sorted(p for p in (REPO_ROOT / "chapters").rglob("*.py") if "__pycache__" not in p.parts)


def public_exports(package: str) -> dict[str, str]:
    """Name -> public module, for every name in the ``__all__`` of a public module of ``package`` (read, not imported)."""
    root = Path(importlib.util.find_spec(package).origin).parent
    exports = {}
    for path in sorted(root.rglob("*.py")):
        parts = [part for part in path.relative_to(root.parents[package.count(".")]).with_suffix("").parts if part != "__init__"]
        if any(part.startswith("_") for part in parts):
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                if isinstance(node.value, (ast.List, ast.Tuple)):
                    exports.update({e.value: ".".join(parts) for e in node.value.elts if isinstance(e, ast.Constant)})
    return exports


def is_module(parent: str, name: str) -> bool:
    """Whether ``parent.name`` is a module file of the installed package (found on disk, nothing imported)."""
    top = importlib.util.find_spec(parent.split(".")[0])
    folder = Path(top.origin).parent.joinpath(*parent.split(".")[1:])
    return (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()


def allowance_problems(source: str) -> list[str]:
    """What is wrong with the private uses of ``source``: unmarked, stray, incomplete, unused or public after all."""
    problems = [f"line {line}: a private-API marker with no private use on its line" for line in stray_markers(source)]
    used = names_in(source)
    for use in private_uses(source):
        if use.marker is None:
            problems.append(f"line {use.line}: {use.module} is private; import it from Ray's public API, or say which "
                            "name it lacks (# private: <name> is not public in <public module>)")
            continue
        names = {n.strip() for n in use.marker["names"].split(",")}
        public = use.marker["public"]
        if PRIVATE.fullmatch(public) or any(part.startswith("_") for part in public.split(".")):
            problems.append(f"line {use.line}: the marker names {public}, which is not a public module")
            continue
        problems += [f"line {use.line}: imports {name} from {use.module} without naming it in the marker"
                     for name in use.imported if name not in names and not is_module(use.module, name)]
        problems += [f"line {use.line}: the marker names {name}, which the module never uses" for name in sorted(names - used)]
        exports = public_exports(".".join(public.split(".")[:2]))
        module = importlib.import_module(public)
        for name in sorted(names):
            where = public if hasattr(module, name) else exports.get(name)
            if where:
                problems.append(f"line {use.line}: {name} is public ({where}): import it from there")
    return problems


def test_no_chapter_imports_a_private_ray_module_without_saying_which_name_it_lacks() -> None:
    unmarked = [f"{path.relative_to(REPO_ROOT)}:{use.line}: {use.module}" for path in chapter_modules()
                for use in private_uses(path.read_text(encoding="utf-8")) if use.marker is None]
    assert unmarked == [], "use Ray's public API (ray.serve, ray.serve.request_router, ...), or mark the line: " \
                           "# private: <name> is not public in <public module>"


def test_every_private_allowance_in_the_chapters_is_needed() -> None:
    pytest.importorskip("ray.serve")
    problems = [f"{path.relative_to(REPO_ROOT)}: {problem}" for path in chapter_modules()
                for problem in allowance_problems(path.read_text(encoding="utf-8"))]
    assert problems == []


# ---------------------------------------------------------------- the checker, on sources made to break it


def test_the_scan_finds_private_imports_attributes_and_module_names() -> None:
    source = ("import ray._private.worker\n"
              "from ray.serve._private.common import ReplicaID\n"
              "from ray.serve import _private\n"
              "from ray.serve.request_router import RequestRouter\n"
              "node = ray._private.worker._global_node\n"
              "m = importlib.import_module('ray.serve._private.router')\n")
    assert [(use.line, use.module) for use in private_uses(source)] == [
        (1, "ray._private.worker"), (2, "ray.serve._private.common"), (3, "ray.serve._private"),
        (5, "ray._private.worker._global_node"), (6, "ray.serve._private.router")]
    assert all(use.marker is None for use in private_uses(source))


def test_an_allowance_must_be_needed_complete_and_used() -> None:
    pytest.importorskip("ray.serve")
    needed = ("from ray.serve._private import replica as serve_replica  # private: add_port_to_grpc_server is not public "
              "in ray.serve\nbind = serve_replica.add_port_to_grpc_server\n")
    assert allowance_problems(needed) == []
    public_after_all = "from ray.serve._private.common import ReplicaID  # private: ReplicaID is not public in ray.serve\nReplicaID\n"
    assert allowance_problems(public_after_all) == ["line 1: ReplicaID is public (ray.serve.request_router): import it from there"]
    unnamed = ("from ray.serve._private.utils import helper, Thing  # private: Thing is not public in ray.serve\n"
               "Thing, helper\n")
    assert allowance_problems(unnamed) == ["line 1: imports helper from ray.serve._private.utils without naming it in the marker"]
    unused = "from ray.serve._private import replica  # private: add_port_to_grpc_server is not public in ray.serve\n"
    assert allowance_problems(unused) == ["line 1: the marker names add_port_to_grpc_server, which the module never uses"]
    stray = "import os  # private: getcwd is not public in os\n"
    assert allowance_problems(stray) == ["line 1: a private-API marker with no private use on its line"]
    unmarked = "from ray.serve._private.request_router.common import PendingRequest\n"
    assert len(allowance_problems(unmarked)) == 1 and "is private" in allowance_problems(unmarked)[0]
