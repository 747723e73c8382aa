"""``make diff``: each lesson's diff shows what the chapter adds, in the order its code tour reads, new files as
new, and never a module it still uses as deleted."""

from __future__ import annotations

import fnmatch
import re

import pytest

from chapters.diff import (
    READING_ORDER,
    WIRING,
    chapter_dir,
    chapter_files,
    chapter_folders,
    module_name,
    modules_used,
    reading_order,
    stat,
    unified,
)

ORDER = list(chapter_folders())
PAIRS = list(zip(ORDER[1:], ORDER[2:]))  # ch01 -> ch02 is a rewrite (Flask to FastAPI): every file changes
FILE_HEADER = re.compile(r"^\+\+\+ \w+/(\S+)$", re.M)


def files_in_diff_order(diff: str) -> list[str]:
    return FILE_HEADER.findall(diff)


def test_every_chapter_folder_can_be_diffed_chapter_9_included() -> None:
    assert ORDER[-1] == "ch09" and len(ORDER) == 9
    added, _ = stat(unified("ch08", "ch09"))
    assert added > 0


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_a_lesson_diff_never_deletes_what_the_chapter_still_uses(before: str, after: str) -> None:
    diff = unified(before, after)
    a_dir, b_dir = chapter_dir(before), chapter_dir(after)
    a_files, b_files = chapter_files(a_dir, False), chapter_files(b_dir, False)
    used = modules_used(b_files)
    for name in set(a_files) - set(b_files):
        assert f"--- {a_dir.name}/{name}\n" not in diff, f"{name} is shown as deleted by {after}"
        how = "uses it" if module_name(a_dir, name) in used else "does not use it"
        assert f"# {a_dir.name}/{name}: not part of this lesson ({b_dir.name} {how})" in diff
    added, removed = stat(diff)
    assert added > 0  # every chapter adds its lesson
    assert removed < added  # a chapter builds on the one before; it does not rewrite it


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_the_diff_reads_in_the_code_tours_order_with_the_wiring_last(before: str, after: str) -> None:
    shown = files_in_diff_order(unified(before, after))
    tour = [name for name in shown if any(fnmatch.fnmatchcase(name, p) for p in READING_ORDER[after])]
    assert shown[: len(tour)] == tour, "the code tour's files come first"
    assert shown == reading_order(after, shown)
    wiring = [i for i, name in enumerate(shown) if any(fnmatch.fnmatchcase(name, p) for p in WIRING)]
    assert "server.py" not in shown or shown[wiring[0]] in ("server.py", "live_view.py", "live_steps.py")
    assert wiring == list(range(len(shown) - len(wiring), len(shown))), f"wiring last: {shown}"


def test_chapter_8_opens_with_its_scheduler_and_ends_with_its_wiring() -> None:
    shown = files_in_diff_order(unified("ch07", "ch08"))
    assert shown[0] == "scheduler.py"
    assert shown.index("block_manager.py") < shown.index("model_runner.py") < shown.index("server.py")
    assert shown[-1].startswith("deploy/")


def test_the_reading_order_names_files_that_exist() -> None:
    """A pattern of the code tour that matches nothing is a tour gone stale (a file renamed or moved)."""
    for chapter, patterns in READING_ORDER.items():
        names = list(chapter_files(chapter_dir(chapter), False))
        for pattern in patterns:
            assert any(fnmatch.fnmatchcase(name, pattern) for name in names), (chapter, pattern)


@pytest.mark.parametrize("chapter", ORDER)
def test_the_diff_order_is_the_order_the_readmes_code_tour_names_the_files(chapter: str) -> None:
    """The lesson and its diff read alike: the chapter's files, as the README's "Code tour" first names
    them, are already in the diff's reading order."""
    folder = chapter_dir(chapter)
    text = (folder / "README.md").read_text()
    assert "## Code tour" in text, f"{folder.name}/README.md has no code tour"
    tour = re.split(r"\n## ", text.split("## Code tour", 1)[1], maxsplit=1)[0]
    files = set(chapter_files(folder, False))
    named: list[str] = []
    for name in re.findall(r"[\w/]+\.(?:py|c|json)\b", tour):
        if name in files and name not in named:
            named.append(name)
    assert len(named) >= 2, named
    assert named == reading_order(chapter, named), "update READING_ORDER in chapters/diff.py, or the tour"


def test_a_new_file_is_headed_as_new_and_all_added() -> None:
    diff = unified("ch02", "ch03")
    section = diff.split("# new file: ch03_dynamic_batching/batcher.py\n", 1)[1].split("\n# new file:", 1)[0]
    assert section.startswith("--- /dev/null\n+++ ch03_dynamic_batching/batcher.py\n@@ -0,0 +1,")
    body = section.splitlines()[3:]
    assert body and all(line.startswith("+") for line in body)
    assert "#   new      batcher.py" in diff.split("--- ", 1)[0], "the summary names it as new"


def test_a_file_that_imports_its_namesake_is_new_not_a_rewrite() -> None:
    # Chapter 8's server.py imports chapter 7's: chapter 7's is not 344 removed lines.
    diff = unified("ch07", "ch08")
    assert "# new file: ch08_continuous_batching/server.py (builds on ch07_production/server.py" in diff
    assert "--- ch07_production/server.py" not in diff
    _, removed = stat(diff)
    assert removed <= 5  # only the one-line entry points change


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
