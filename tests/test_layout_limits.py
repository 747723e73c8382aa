"""The layout's limits, counted on the tree: a reader can hold every module and function, and see the architecture.

- chapter 8's core (:data:`CORE_FILES`, the engine that serves by itself with ``--attention gather``) is at
  most :data:`CORE_MAX_LINES` lines of Python counted without docstrings, comments and blank lines, and
  imports nothing of its fast path (``fast/``, at most :data:`FAST_MAX_LINES` such lines);
- the chapters' lines are at most :data:`NON_CODE_MAX_SHARE` docstrings, comments and blank lines;
- no function in ``chapters/`` is longer than :data:`FUNCTION_MAX_LINES` lines;
- no module in ``chapters/`` or ``benchmarks/`` is longer than :data:`MODULE_MAX_LINES` lines;
- ``benchmarks/reference/`` holds data only (no ``.py`` or ``.sh``), and ``benchmarks/`` shows its
  parts at its top level, at most :data:`BENCHMARKS_MAX_ENTRIES` entries.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from shared.paths import REPO_ROOT

CH08 = REPO_ROOT / "chapters" / "ch08_continuous_batching"
# The core as the lesson's code tour names it: a sequence's state, the scheduler, the block ledger, the paged
# cache, the model runner, the paged-attention seam with its plain backend, the sampler and the step thread.
CORE_FILES = (
    "sequence.py", "scheduler.py", "block_manager.py", "paged_cache.py", "model_runner.py",
    "paged_attention.py", "attention_gather.py", "sampling.py", "step_thread.py",
)
CORE_MAX_LINES = 900
FAST_MAX_LINES = 500
NON_CODE_MAX_SHARE = 0.30
FUNCTION_MAX_LINES = 80
MODULE_MAX_LINES = 600
BENCHMARKS_MAX_ENTRIES = 12


def python_code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a module's, class's or function's docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def code_lines(path: Path) -> int:
    return python_code_lines(path.read_text(encoding="utf-8"))


def modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO_ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_counters_skip_docstrings_comments_and_blank_lines() -> None:
    python = '"""Module."""\n\n# a comment\ndef f(x):\n    """Doc,\n    two lines."""\n    return (x +\n            1)  # why\n'
    assert python_code_lines(python) == 3  # def, and the two lines of the return


def test_chapter_8s_core_and_its_fast_path_are_at_most_their_budgets_of_code_lines() -> None:
    core = {name: code_lines(CH08 / name) for name in CORE_FILES}
    assert sum(core.values()) <= CORE_MAX_LINES, core
    fast = {path.name: code_lines(path) for path in sorted((CH08 / "fast").glob("*.py"))}
    assert sum(fast.values()) <= FAST_MAX_LINES, fast


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute names (``from . import x`` resolved against the chapter's package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = path.relative_to(REPO_ROOT).parent.parts
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_chapter_8s_core_imports_nothing_of_its_fast_path() -> None:
    fast = "chapters.ch08_continuous_batching.fast"
    reaching = {name: sorted(m for m in imported_modules(CH08 / name) if m == fast or m.startswith(fast + "."))
                for name in CORE_FILES}
    assert {name: found for name, found in reaching.items() if found} == {}


def test_the_chapters_are_mostly_code() -> None:
    files = modules("chapters")
    total = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)
    code = sum(code_lines(p) for p in files)
    assert 1 - code / total <= NON_CODE_MAX_SHARE, f"{1 - code / total:.1%} of {total} lines are not code"


def test_no_function_in_the_chapters_is_longer_than_a_screen_or_two() -> None:
    long = []
    for path in modules("chapters"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > FUNCTION_MAX_LINES:
                long.append(f"{path.relative_to(REPO_ROOT)}::{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_no_module_in_the_chapters_or_the_benchmarks_is_longer_than_a_reader_can_hold() -> None:
    long = {str(p.relative_to(REPO_ROOT)): n for p in modules("chapters", "benchmarks")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_MAX_LINES}
    assert long == {}


def test_the_reference_results_hold_data_only() -> None:
    scripts = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "benchmarks" / "reference").rglob("*")
                     if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)
    assert scripts == []


def test_the_benchmarks_top_level_shows_its_parts() -> None:
    entries = sorted(p.name for p in (REPO_ROOT / "benchmarks").iterdir() if p.name != "__pycache__")
    assert len(entries) <= BENCHMARKS_MAX_ENTRIES, entries
