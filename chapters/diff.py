"""``python -m chapters.diff ch02 ch03``: what chapter TO changes over chapter FROM, code only.

A chapter folder holds only what its lesson adds or changes, so a file of FROM that TO does not have
is never a deletion: it is named in one line (and whether TO still uses it, directly or through
another module it imports), not diffed. Lesson READMEs differ by nature and are left out
(``--readme`` includes them). ``--stat`` prints only the counts of lines added and removed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

from chapters import CHAPTERS, module_for

SKIP = {"__pycache__"}
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def chapter_dir(chapter: str) -> Path:
    return Path(__file__).parent / module_for(chapter).split(".", 1)[1]


def chapter_files(root: Path, with_readme: bool) -> dict[str, Path]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not SKIP.intersection(path.parts) and path.suffix != ".pyc":
            if with_readme or path.name != "README.md":
                files[str(path.relative_to(root))] = path
    return files


def module_file(module: str) -> Path | None:
    """The source file of a ``chapters.*`` module, or None for anything else."""
    if not module.startswith("chapters."):
        return None
    base = PACKAGE_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """The ``chapters.*`` modules a file imports (``from a.b import c`` counts ``a.b`` and ``a.b.c``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("chapters.")}


def modules_used(files: dict[str, Path]) -> set[str]:
    """Every ``chapters.*`` module reachable from ``files`` by imports, transitively."""
    used: set[str] = set()
    pending = [path for name, path in files.items() if name.endswith(".py")]
    while pending:
        for module in imported_modules(pending.pop()):
            path = module_file(module)
            if path is not None and module not in used:
                used.add(module)
                pending.append(path)
    return used


def module_name(chapter_root: Path, file_name: str) -> str:
    return f"chapters.{chapter_root.name}.{file_name.removesuffix('.py').replace('/', '.')}"


def unified(from_chapter: str, to_chapter: str, with_readme: bool = False) -> str:
    """The unified diff of the two chapters' files, modules TO still uses named instead of deleted."""
    a_dir, b_dir = chapter_dir(from_chapter), chapter_dir(to_chapter)
    a_files, b_files = chapter_files(a_dir, with_readme), chapter_files(b_dir, with_readme)
    used = modules_used(b_files)
    out = []
    for name in sorted(set(a_files) | set(b_files)):
        if name not in b_files:
            how = "uses it" if module_name(a_dir, name) in used else "does not use it"
            out.append(f"# {a_dir.name}/{name}: not part of this lesson ({b_dir.name} {how})\n")
            continue
        a = a_files[name].read_text().splitlines(keepends=True) if name in a_files else []
        b = b_files[name].read_text().splitlines(keepends=True) if name in b_files else []
        out.extend(difflib.unified_diff(a, b, f"{a_dir.name}/{name}", f"{b_dir.name}/{name}"))
    return "".join(out)


def stat(diff: str) -> tuple[int, int]:
    """Lines added and removed in a unified diff (headers not counted)."""
    lines = diff.splitlines()
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    return added, removed


README = PACKAGE_ROOT / "README.md"
BLOCK_START, BLOCK_END = "<!-- diffs -->", "<!-- /diffs -->"


def diff_table() -> str:
    """Each lesson's diff size, consecutive chapters, as a markdown table."""
    order = list(CHAPTERS)
    lines = ["| lesson | `make diff` | lines added | lines removed |", "|---|---|---|---|"]
    for before, after in zip(order, order[1:]):
        added, removed = stat(unified(before, after))
        lines.append(f"| {before} → {after} | `make diff FROM={before} TO={after}` | {added} | {removed} |")
    return "\n".join(lines)


def write_readme_block(path: Path = README) -> None:
    """Rewrite the README's ``<!-- diffs -->`` block from the chapters as they are now."""
    text = path.read_text()
    start, end = text.index(BLOCK_START) + len(BLOCK_START), text.index(BLOCK_END)
    path.write_text(text[:start] + "\n" + diff_table() + "\n" + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("from_chapter", nargs="?", choices=sorted(CHAPTERS))
    parser.add_argument("to_chapter", nargs="?", choices=sorted(CHAPTERS))
    parser.add_argument("--readme", action="store_true", help="include the lesson READMEs")
    parser.add_argument("--stat", action="store_true", help="print only the lines added and removed")
    parser.add_argument("--write-readme-table", action="store_true", help="rewrite the diff-size table of README.md")
    args = parser.parse_args()
    if args.write_readme_table:
        write_readme_block()
        return
    if not (args.from_chapter and args.to_chapter):
        parser.error("name two chapters, or pass --write-readme-table")
    diff = unified(args.from_chapter, args.to_chapter, args.readme)
    if args.stat:
        added, removed = stat(diff)
        sys.stdout.write(f"+{added} -{removed}\n")
    else:
        sys.stdout.write(diff)


if __name__ == "__main__":
    main()
