"""Code states contracts, not history: no docstring or comment in ``chapters/``, ``shared/`` or ``benchmarks/harness/``
quotes a measured figure (milliseconds, QPS, tokens/s, GB/s, a speed-up, a percentage), a commit, an issue, or what
was tried. Measurements live in results files and the pages generated from them; history in commit messages."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from shared.paths import REPO_ROOT

FOLDERS = ("chapters", "shared", "benchmarks/harness")
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|QPS|req/s|tokens/s|GB/s|MB/s|x faster|×|%)(?![\w/])"
                    r"|\bcommit [0-9a-f]{7,40}\b|\b[0-9a-f]{7,12}\b(?= commit)|\bissue #?\d+|\b(?:tried|used to)\b", re.I)
# Units a contract states (a rounding, a scale), not a measurement: (file, the text matched).
CONTRACT_UNITS = {
    ("benchmarks/harness/summaries.py", "0.1 ms"),  # the precision latencies are rounded to
    ("benchmarks/harness/resource_sampler.py", "100 %"),  # the scale: one core busy
    ("chapters/ch08_continuous_batching/openai_api.py", "tried"),  # what pydantic does with a union, not our history
}


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    texts = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                texts.append((first.lineno, first.value.value))
    return texts


def figures_in(path: Path) -> list[str]:
    relative = path.relative_to(REPO_ROOT).as_posix()
    return [f"{relative}:{line}: {match.group(0)!r}" for line, text in comments_and_docstrings(path.read_text(encoding="utf-8"))
            for match in FIGURE.finditer(text) if (relative, match.group(0)) not in CONTRACT_UNITS]


def test_the_scan_sees_a_figure_a_commit_and_a_story() -> None:
    source = '"""Took 12.5 ms here."""\n# 3x faster? no: 1.4× (commit 1a2b3c4)\ndef f():\n    """We tried a queue; see issue 44."""\n'
    found = [m.group(0) for _, text in comments_and_docstrings(source) for m in FIGURE.finditer(text)]
    assert sorted(found) == sorted(["12.5 ms", "3x faster", "1.4×", "commit 1a2b3c4", "tried", "issue 44"])


def test_no_docstring_or_comment_quotes_a_measurement_or_history() -> None:
    found = [hit for folder in FOLDERS for path in sorted((REPO_ROOT / folder).rglob("*.py"))
             if "__pycache__" not in path.parts for hit in figures_in(path)]
    assert found == []
