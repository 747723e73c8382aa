"""Execute the notebooks of ``notebooks/`` (``make notebooks``): in place, so they are committed with their figures.

    python -m benchmarks.notebooks                      # every notebook, against the committed reference results
    python -m benchmarks.notebooks ch03_dynamic_batching --results-dir benchmarks/results/cpu --out /tmp/nb

Executed in place, each notebook's first figure is also written to ``notebooks/figures/<name>.png``,
which the chapter's README shows, and its titles (as drawn) to ``notebooks/figures/titles.json`` with
the PNG's hash: a README caption is checked against them (``tests/test_notebooks.py``).

A notebook reads ``$SFS_RESULTS_DIR`` (default: ``benchmarks/reference/<profile>``); ``--results-dir``
sets it for the kernel. Execution fails on any error, including a figure with an empty panel (the
notebooks display figures through :func:`benchmarks.report.notebook_plots.show`, which refuses those).
nbclient runs each notebook in a fresh Jupyter kernel: Locust is never imported in-process.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

from benchmarks.harness.results import REPO_ROOT

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
FIGURES_DIR = NOTEBOOKS_DIR / "figures"
TITLES_FILE = FIGURES_DIR / "titles.json"
CELL_TIMEOUT_S = 300


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    """Every notebook (sorted), or those named (with or without ``.ipynb``)."""
    if not names:
        return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    paths = [NOTEBOOKS_DIR / (name if name.endswith(".ipynb") else f"{name}.ipynb") for name in names]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"no such notebook: {', '.join(missing)}")
    return paths


@contextmanager
def _environment(values: Mapping[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def execute(path: Path, env: Mapping[str, str] | None = None, timeout_s: int = CELL_TIMEOUT_S):
    """Run ``path`` top to bottom in a fresh kernel (which inherits ``env``); returns the executed notebook.

    Raises nbclient's ``CellExecutionError`` on the first cell that fails.
    """
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(Path(path).parent)}})
    with _environment(env or {}):
        client.execute()
    return notebook


def main_figure(notebook) -> tuple[bytes, list[str]] | None:
    """The PNG bytes of a notebook's first figure (each notebook plots its chapter's mechanism first) and
    its titles as :func:`benchmarks.report.notebook_plots.show` recorded them, or None."""
    import base64

    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            png = output.get("data", {}).get("image/png")
            if png:
                return base64.b64decode(png), list(output.get("metadata", {}).get("figure_titles", []))
    return None


def record_figure(stem: str, png: bytes, titles: list[str], figures_dir: Path = FIGURES_DIR) -> None:
    """Write ``<stem>.png`` and its entry in ``titles.json`` (titles and the PNG's sha256)."""
    import hashlib
    import json

    figures_dir.mkdir(parents=True, exist_ok=True)
    (figures_dir / f"{stem}.png").write_bytes(png)
    manifest_path = figures_dir / TITLES_FILE.name
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest[stem] = {"titles": titles, "png_sha256": hashlib.sha256(png).hexdigest()}
    manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(prog="python -m benchmarks.notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebooks to run (default: all)")
    parser.add_argument("--results-dir", type=Path, help="SFS_RESULTS_DIR for the notebooks")
    parser.add_argument("--out", type=Path, help="write the executed notebooks here instead of in place")
    args = parser.parse_args(argv)
    env = {"SFS_RESULTS_DIR": str(args.results_dir.resolve())} if args.results_dir else {}
    for path in notebook_paths(args.names):
        notebook = execute(path, env)
        target = (args.out / path.name) if args.out else path
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target)
        print(f"executed {path.name} -> {target}")
        figure = main_figure(notebook)
        if figure is not None and not args.out:  # the chapter READMEs show it
            record_figure(path.stem, *figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
