"""``make diff``: each lesson's diff shows what the chapter adds or changes, and never a module it still uses as deleted."""

from __future__ import annotations

import pytest

from chapters import CHAPTERS
from chapters.diff import chapter_dir, chapter_files, module_name, modules_used, stat, unified

PAIRS = list(zip(list(CHAPTERS)[1:], list(CHAPTERS)[2:]))  # ch01 -> ch02 is a rewrite (Flask to FastAPI): every file changes


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_a_lesson_diff_never_deletes_what_the_chapter_still_uses(before: str, after: str) -> None:
    diff = unified(before, after)
    a_dir, b_dir = chapter_dir(before), chapter_dir(after)
    a_files, b_files = chapter_files(a_dir, False), chapter_files(b_dir, False)
    used = modules_used(b_files)
    for name in set(a_files) - set(b_files):
        assert f"--- {a_dir.name}/{name}\n" not in diff, f"{name} is shown as deleted by {after}"
        if module_name(a_dir, name) in used:
            assert f"# {a_dir.name}/{name}: not part of this lesson ({b_dir.name} uses it)" in diff
    added, removed = stat(diff)
    assert added > 0  # every chapter adds its lesson
    assert removed < added  # a chapter builds on the one before; it does not rewrite it


def test_a_module_reached_through_another_chapters_import_counts_as_used() -> None:
    # ch06 imports ch05's server, which imports ch04's server, which imports ch04's admission.
    used = modules_used(chapter_files(chapter_dir("ch06"), False))
    assert "chapters.ch04_memory_pool.admission" in used
    assert "chapters.ch03_dynamic_batching.step_loop" in used


def test_the_readme_table_of_diff_sizes_is_current() -> None:
    from chapters.diff import BLOCK_END, BLOCK_START, README, diff_table

    text = README.read_text()
    block = text[text.index(BLOCK_START) + len(BLOCK_START) : text.index(BLOCK_END)].strip()
    assert block == diff_table(), "README's diff table is stale: run python -m chapters.diff --write-readme-table"
