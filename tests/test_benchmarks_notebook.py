"""The climb notebook runs top to bottom, on synthetic results so it needs no benchmark run."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from benchmarks.report import write_report
from benchmarks.synthetic import write_synthetic_climb

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "climb.ipynb"


def test_climb_notebook_executes_on_synthetic_results(tmp_path: Path, monkeypatch):
    write_synthetic_climb(tmp_path)
    write_report(tmp_path)
    monkeypatch.setenv("SFS_RESULTS_DIR", str(tmp_path))  # the kernel inherits this process's environment
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    assert "3 runs in" in text
    assert "| ch02 | 25.0 |" in text  # the synthetic ch02 peaks at 25 QPS
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # the climb and latency-vs-load plots
