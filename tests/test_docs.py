"""The pages a reader follows: every relative link and image in every Markdown file resolves, every
generated results block is what `python -m benchmarks readme` writes from the committed results, and
each page is short enough to read in one sitting (the limits CONTRIBUTING.md states)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.report.readme_blocks import rewritten_readmes

ROOT = Path(__file__).resolve().parent.parent
# [text](target) and ![alt](target), a target without spaces; <img src="target">.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG = re.compile(r"<img[^>]+src=\"([^\"]+)\"")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def markdown_files() -> list[Path]:
    """Tracked and not-ignored Markdown files of the working tree; every one below the root where the
    tree is not a git checkout (a learner's student tree)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0 or not (ROOT / ".git").exists():
        skipped = {".git", ".venv", "node_modules", ".pytest_cache", ".hypothesis"}
        return sorted(p for p in ROOT.rglob("*.md") if not skipped.intersection(p.relative_to(ROOT).parts))
    return [ROOT / name for name in listed.stdout.split() if (ROOT / name).exists()]


def relative_targets(page: Path) -> list[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    targets = LINK.findall(text) + IMG.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_finds_links_images_and_skips_code_and_urls(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text('[a](x.md) ![b](img/p.png "t") <img src="c.png"> [u](https://e.org) [s](#top) `[c](no.md)`\n'
                    "```\n[d](no2.md)\n```\n[e](dir/f.md#part)\n")
    assert relative_targets(page) == ["x.md", "img/p.png", "dir/f.md#part", "c.png"]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page: Path) -> None:
    broken = [target for target in relative_targets(page)
              if not (page.parent / target.split("#", 1)[0]).resolve().exists()]
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_every_results_block_is_what_the_committed_results_write() -> None:
    stale = [str(page.relative_to(ROOT)) for page in rewritten_readmes()]
    assert not stale, f"run `python -m benchmarks readme`: these pages' blocks are stale: {stale}"


LIMITS = {"README.md": 250, "CONTRIBUTING.md": 150, "chapters/ch08_continuous_batching/README.md": 450}


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "chapters").glob("ch*/README.md"))])
def test_each_lesson_reads_in_one_sitting(page: str) -> None:
    lines = (ROOT / page).read_text(encoding="utf-8").count("\n")
    assert lines <= LIMITS.get(page, 350), f"{page}: {lines} lines"
