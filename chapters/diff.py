"""``python -m chapters.diff ch07 ch08``: what chapter TO adds over chapter FROM, in the order of its lesson.

A chapter folder holds only what its lesson adds or changes, and a later chapter imports what an
earlier one taught instead of copying it. So the diff of two folders is the lesson, provided it is
read the way the lesson is taught:

- **In reading order.** The files come in the order of the chapter README's code tour
  (:data:`READING_ORDER`: the modules that carry the idea first), then any other module, then the
  wiring (:data:`WIRING`: the server that composes the parts, the entry point, the live page's
  files, deployment files) last. A summary at the top lists every file in that order with its size.
- **New files as new.** A file TO adds is headed ``# new file:`` and diffed against ``/dev/null``,
  every line added. So is a file whose name FROM also has when TO imports FROM's version (chapter 8's
  ``server.py`` builds on chapter 7's): it is a new module beside the old one, not a rewrite of it.
- **Nothing imported unchanged.** A file of FROM that TO does not have, or builds on, is never a
  deletion: it is named in one line (and whether TO still uses it, directly or through another
  module it imports), not diffed.

A chapter's pages (``README.md``, ``RESULTS.md``) differ by nature and are left out (``--readme``
includes them, last). ``--stat``
prints only the counts of lines added and removed. Any chapter folder can be named, chapter 9
included (it is not in :data:`chapters.CHAPTERS`, the climb's list, because it is measured by its
own recorders).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import re
import sys
from pathlib import Path

SKIP = {"__pycache__"}
CHAPTERS_ROOT = Path(__file__).resolve().parent
PACKAGE_ROOT = CHAPTERS_ROOT.parent

# Each chapter's code tour (its README's "Code tour", same order): file patterns, relative to the
# chapter folder. Patterns rather than names so that a module split in two keeps its place.
READING_ORDER: dict[str, tuple[str, ...]] = {
    "ch01": ("api.py",),
    "ch02": ("api.py",),
    "ch03": ("batcher.py", "step_loop.py", "batched_generation.py"),
    "ch04": ("memory_pool.py", "admission.py", "pooled_backend.py", "memory_report.py"),
    "ch05": ("engine.py", "bf16_matmul.py", "fused_blocks.py", "fused_block_ops.c", "native_library.py", "engines.py", "compiled_engine.py", "cudagraph_engine.py",
             "onnx_engine.py", "tensorrt_engine.py"),
    "ch06": ("adaptive_window.py", "tuned.json"),
    "ch07": ("health.py", "drain.py", "deadlines.py", "metrics.py", "request_log.py", "model_registry.py",
             "leakcheck.py", "startup_heap.py"),
    "ch08": ("scheduler.py", "sequence.py", "block_manager.py", "paged_cache.py", "model_runner.py", "paged_attention.py",
             "attention_gather.py", "sampling.py", "stop_strings.py", "step_thread.py", "request_stream.py",
             "continuous_backend.py", "streaming.py", "openai_api.py", "chat_api.py", "sampled_contract.py",
             "continuous_metrics.py", "tracing.py", "step_tracing.py",
             "fast/attention_flex.py", "fast/attention_kernel.py", "fast/*.c", "fast/attention_choice.py",
             "fast/startup_cache.py", "fast/cuda_graphs.py", "fast/*"),
    "ch09": ("replica.py", "deployment_choice.py", "routing.py", "edge.py", "cluster.py", "stopping.py", "simulation.py"),
}

# What composes the lesson rather than teaching it, shown last in this order, in every chapter.
WIRING: tuple[str, ...] = ("live_*.py", "server.py", "__main__.py", "__init__.py", "ui/*", "deploy/*", "Dockerfile*",
                           "README.md", "RESULTS.md")
# The lesson's pages, not its code: left out unless --readme asks for them.
PAGES = {"README.md", "RESULTS.md"}


def chapter_folders() -> dict[str, str]:
    """Every chapter folder by its id: ``{"ch01": "ch01_flask_sync", ...}``, chapter 9 included."""
    folders = {}
    for path in sorted(CHAPTERS_ROOT.iterdir()):
        if path.is_dir() and re.fullmatch(r"ch\d\d_\w+", path.name):
            folders[path.name[:4]] = path.name
    return folders


def chapter_dir(chapter: str) -> Path:
    """``ch03`` (or ``ch03_dynamic_batching``) -> the chapter's folder."""
    folders = chapter_folders()
    folder = folders.get(chapter, chapter)
    if folder not in folders.values():
        raise KeyError(f"unknown chapter {chapter!r}; known: {', '.join(folders)}")
    return CHAPTERS_ROOT / folder


def chapter_files(root: Path, with_readme: bool) -> dict[str, Path]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not SKIP.intersection(path.parts) and path.suffix != ".pyc":
            if with_readme or path.name not in PAGES:
                files[path.relative_to(root).as_posix()] = path
    return files


def _first_match(name: str, patterns: tuple[str, ...]) -> int | None:
    return next((index for index, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)), None)


def reading_order(chapter: str, names: set[str] | list[str]) -> list[str]:
    """``names`` (files of a chapter folder) as the lesson reads them: the code tour's files in its
    order, then the other modules by name, then the wiring in :data:`WIRING`'s order."""
    tour = READING_ORDER.get(chapter_dir(chapter).name[:4], ())

    def rank(name: str) -> tuple[int, int, str]:
        wiring = _first_match(name, WIRING)
        if wiring is not None:
            return (2, wiring, name)
        in_tour = _first_match(name, tour)
        return (0, in_tour, name) if in_tour is not None else (1, 0, name)

    return sorted(names, key=rank)


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


def _lines(path: Path) -> list[str]:
    lines = path.read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):  # so the next file's header starts on a line of its own
        lines[-1] += "\n"
    return lines


def unified(from_chapter: str, to_chapter: str, with_readme: bool = False) -> str:
    """The lesson's diff: a summary in reading order, then each file's diff in the same order."""
    a_dir, b_dir = chapter_dir(from_chapter), chapter_dir(to_chapter)
    a_files, b_files = chapter_files(a_dir, with_readme), chapter_files(b_dir, with_readme)
    used = modules_used(b_files)
    summary = [f"# make diff FROM={a_dir.name[:4]} TO={b_dir.name[:4]}: {b_dir.name} over {a_dir.name}, "
               "in the order of the lesson's code tour\n"]
    bodies = []
    for name in reading_order(b_dir.name, set(b_files)):
        builds_on = name in a_files and module_name(a_dir, name) in used
        if name in a_files and not builds_on:
            body = list(difflib.unified_diff(_lines(a_files[name]), _lines(b_files[name]),
                                             f"{a_dir.name}/{name}", f"{b_dir.name}/{name}"))
            if not body:
                continue  # the same file in both: not part of the lesson
            how = "changed"
        else:
            note = f" (builds on {a_dir.name}/{name}, which it imports unchanged)" if builds_on else ""
            body = [f"# new file: {b_dir.name}/{name}{note}\n",
                    *difflib.unified_diff([], _lines(b_files[name]), "/dev/null", f"{b_dir.name}/{name}")]
            how = "new"
        added, removed = stat("".join(body))
        summary.append(f"#   {how:<8} {name:<34} +{added} -{removed}\n")
        bodies.extend(body)
    for name in sorted(set(a_files) - set(b_files)):
        how = "uses it" if module_name(a_dir, name) in used else "does not use it"
        summary.append(f"# {a_dir.name}/{name}: not part of this lesson ({b_dir.name} {how})\n")
    return "".join(summary + bodies)


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
    order = list(chapter_folders())
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
    chapters = sorted(chapter_folders())
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("from_chapter", nargs="?", choices=chapters)
    parser.add_argument("to_chapter", nargs="?", choices=chapters)
    parser.add_argument("--readme", action="store_true", help="include the chapters' README.md and RESULTS.md")
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
