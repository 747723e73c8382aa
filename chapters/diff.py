"""``python -m chapters.diff ch02 ch03``: what chapter TO changes over chapter FROM, code only.

Lesson READMEs differ by nature and are left out (``--readme`` includes them).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from chapters import CHAPTERS, module_for

SKIP = {"__pycache__"}


def chapter_dir(chapter: str) -> Path:
    return Path(__file__).parent / module_for(chapter).split(".", 1)[1]


def chapter_files(root: Path, with_readme: bool) -> dict[str, Path]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not SKIP.intersection(path.parts) and path.suffix != ".pyc":
            if with_readme or path.name != "README.md":
                files[str(path.relative_to(root))] = path
    return files


def imported_by(module: str, files: dict[str, Path]) -> bool:
    return any(module in path.read_text() for name, path in files.items() if name.endswith(".py"))


def unified(from_chapter: str, to_chapter: str, with_readme: bool = False) -> str:
    """The unified diff of the two chapters' files. A module of FROM that TO imports instead of
    copying is not a deletion: it is named in one line and not diffed."""
    a_dir, b_dir = chapter_dir(from_chapter), chapter_dir(to_chapter)
    a_files, b_files = chapter_files(a_dir, with_readme), chapter_files(b_dir, with_readme)
    out = []
    for name in sorted(set(a_files) | set(b_files)):
        module = f"chapters.{a_dir.name}.{name.removesuffix('.py').replace('/', '.')}"
        if name not in b_files and imported_by(module, b_files):
            out.append(f"# {a_dir.name}/{name}: unchanged, {b_dir.name} imports it\n")
            continue
        a = a_files[name].read_text().splitlines(keepends=True) if name in a_files else []
        b = b_files[name].read_text().splitlines(keepends=True) if name in b_files else []
        out.extend(difflib.unified_diff(a, b, f"{a_dir.name}/{name}", f"{b_dir.name}/{name}"))
    return "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("from_chapter", choices=sorted(CHAPTERS))
    parser.add_argument("to_chapter", choices=sorted(CHAPTERS))
    parser.add_argument("--readme", action="store_true", help="include the lesson READMEs")
    args = parser.parse_args()
    sys.stdout.write(unified(args.from_chapter, args.to_chapter, args.readme))


if __name__ == "__main__":
    main()
