"""Every notebook runs top to bottom, against synthetic schema-2 results and against the committed reference.

A notebook displays each figure through ``benchmarks.report.notebook_plots.show``, which raises on a figure
with an empty panel, so an empty plot fails here as an error. Against synthetic results (slow: which hold
every recorded field) every plot must draw: a "no data" note there means the plotting code and the
results schema have drifted apart. Against the committed reference every plot must draw too (a claim
whose data is not committed goes, or its data is measured), every workload the notebook's text names
must have results there, and the main figure's titles must be the ones recorded beside the PNG that
the chapter's README shows, whose caption must name only what those titles say.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from benchmarks.harness.results import REFERENCE_ROOT, REPO_ROOT, load_results
from benchmarks.harness.streaming import WORKLOADS as STREAMING_WORKLOADS
from benchmarks.harness.workload import WORKLOADS
from benchmarks.notebooks import TITLES_FILE, execute, main_figure, notebook_paths
from synthetic_results import (
    synthetic_drain_timeline,
    synthetic_leak_report,
    write_synthetic_production_and_streaming,
    write_synthetic_reference,
)

NOTEBOOKS = notebook_paths()
NO_DATA = "No data for this plot"
# Notebooks whose data come from their own recorders, with the files each one reads (under the results dir).
OWN_RECORDINGS = {
    "ch07_production": ("ch07/drain-timeline.json", "ch07/leak-leaky.json", "ch07/leak-fixed.json"),
    "ch08_continuous_batching": ("streaming/mixed.json", "streaming/default.json", "ch08/prefix-caching/shared-prefix.json"),
    "ch09_scale_out": ("ch09/failure-drill.json", "ch09/failure-drill-chapter-defaults.json", "ch09/failure-drill-spare-1.json",
                       "ch09/autoscale-timeline.json",
                       "ch09/replicas-and-routers.json", "ch09/serve-path-default.json", "ch09/simulation.json"),
}


@pytest.fixture(scope="module")
def synthetic_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_reference(root / "cpu", "cpu")
    write_synthetic_reference(root / "cpu" / "climb-smollm2", "cpu")  # the real model's climb, where the notebooks read it
    write_synthetic_production_and_streaming(root / "cpu")
    write_synthetic_reference(root / "gpu", "gpu", calibration_scale=20.0)
    return {"SFS_RESULTS_DIR": str(root / "cpu"), "SFS_GPU_RESULTS_DIR": str(root / "gpu")}


def _outputs(notebook) -> list:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def _images(notebook) -> int:
    return sum("image/png" in output.get("data", {}) for output in _outputs(notebook))


def _text(notebook) -> str:
    return "\n".join(str(output.get("text", "")) + str(output.get("data", {}).get("text/markdown", ""))
                     for output in _outputs(notebook))


def _show_calls(notebook) -> int:
    return sum(cell.source.count("show(") for cell in notebook.cells if cell.cell_type == "code")


def _notes(notebook) -> list[str]:
    return [markdown for output in _outputs(notebook)
            if NO_DATA in (markdown := str(output.get("data", {}).get("text/markdown", "")))]


def test_every_chapter_of_the_article_has_a_notebook():
    names = {path.stem for path in NOTEBOOKS}
    assert {"ch01_flask_sync", "ch02_fastapi_async", "ch03_dynamic_batching", "ch04_memory_pool",
            "ch05_inference_engine", "ch06_tuned_batching", "ch07_production", "ch08_continuous_batching",
            "climb"} <= names
    for path in NOTEBOOKS:
        assert "## What to look at" in path.read_text(), f"{path.name} must end with 'what to look at'"


# Slow (make test-slow): the committed reference, which the same harness writes, is drawn in full by
# the test after it on every run; this one also covers fields the reference may lack (a GPU's).
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_draws_every_plot_from_synthetic_results(path: Path, synthetic_dirs):
    notebook = execute(path, synthetic_dirs)  # raises on any cell error, an empty figure included
    assert not [o for o in _outputs(notebook) if o.output_type == "error"]
    assert NO_DATA not in _text(notebook)
    assert _images(notebook) == _show_calls(notebook)  # one figure per show(...)


def workloads_with_results(directory: Path) -> set[str]:
    """The workloads ``directory`` holds results of: climbs (``<label>[-<workload>].json``) and streaming comparisons."""
    climbs = {workload for workload in WORKLOADS if load_results(directory, workload)}
    streamed = {json.loads(path.read_text())["workload"] for path in (directory / "streaming").glob("*.json")}
    return climbs | streamed


def named_workloads(notebook) -> set[str]:
    """Workloads the rendered notebook names in code font (`long`, `mixed`, ...), in its text and its outputs."""
    text = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown") + _text(notebook)
    known = set(WORKLOADS) | set(STREAMING_WORKLOADS)
    return {name for name in re.findall(r"`([a-z_]+)`", text) if name in known}


# Chapter 9's notebook plots Ray Serve recordings and the simulation, which change with chapter 9
# alone: its two executions (the slowest of all) run with make test-slow.
SLOW_NOTEBOOKS = {"ch09_scale_out"}
# Executing a notebook starts a kernel: the notebooks of chapters 1-5 and 7, whose reference files
# change with their own chapters only, execute on them with make test-slow; every notebook still
# draws every plot from synthetic results above on every run.
SLOW_ON_REFERENCE = SLOW_NOTEBOOKS | {"ch01_flask_sync", "ch02_fastapi_async", "ch03_dynamic_batching", "ch04_memory_pool",
                                     "ch05_inference_engine", "ch07_production"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_ON_REFERENCE else p for p in NOTEBOOKS],
                         ids=lambda p: p.stem)
def test_notebook_runs_on_the_committed_reference(path: Path):
    reference = REFERENCE_ROOT / "cpu"
    notebook = execute(path, {"SFS_RESULTS_DIR": str(reference)})
    assert not _notes(notebook), "the committed reference lacks data a plot of this notebook describes"
    assert _images(notebook) == _show_calls(notebook)
    missing = named_workloads(notebook) - workloads_with_results(reference)
    assert not missing, f"the notebook's text names workloads without committed results: {missing}"
    if path.stem != "climb":  # the chapter notebooks' first figure is their README's
        recorded = json.loads(TITLES_FILE.read_text())[path.stem]
        assert main_figure(notebook)[1] == recorded["titles"], "re-run `make notebooks`: the main figure changed"


IMAGE = re.compile(r"!\[(?P<caption>[^\]]*)\]\((?P<target>[^)]+\.png)\)")


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9.%]+", " ", text.lower()).split())


def caption_problems(readme: Path, manifest: dict, figures_dir: Path = TITLES_FILE.parent) -> list[str]:
    """What a README says about a notebook figure that the figure does not show: every `; `-separated
    part of an image's caption must be said by one of the titles recorded for that PNG, whose hash
    must be the PNG's own (the titles belong to this image, not an older one)."""
    problems = []
    for match in IMAGE.finditer(readme.read_text()):
        png = (readme.parent / match["target"]).resolve()
        if png.parent != figures_dir.resolve():
            continue  # not a notebook figure
        entry = manifest.get(png.stem)
        if entry is None or not png.exists():
            problems.append(f"{readme.name}: {png.name} has no recorded titles (run `make notebooks`)")
            continue
        if hashlib.sha256(png.read_bytes()).hexdigest() != entry["png_sha256"]:
            problems.append(f"{readme.name}: {png.name} is not the image its titles were recorded with")
        titles = [_words(title) for title in entry["titles"]]
        for part in match["caption"].split("; "):
            if not any(_words(part) in title for title in titles):
                problems.append(f"{readme.name}: caption {part!r} is not in {png.name}'s titles {entry['titles']}")
    return problems


def test_every_readme_caption_names_what_its_figure_shows():
    manifest = json.loads(TITLES_FILE.read_text())
    readmes = sorted(REPO_ROOT.glob("*.md")) + sorted(REPO_ROOT.glob("chapters/*/README.md"))
    problems = [problem for readme in readmes for problem in caption_problems(readme, manifest)]
    assert not problems, "\n".join(problems)
    shown = {m["target"].rsplit("/", 1)[-1][:-4] for r in readmes for m in IMAGE.finditer(r.read_text())}
    assert {p.stem for p in NOTEBOOKS} - {"climb"} <= shown, "every chapter's README shows its notebook's main figure"


def test_the_caption_check_catches_a_caption_the_figure_does_not_show(tmp_path: Path):
    figures = tmp_path / "figures"
    figures.mkdir()
    png = figures / "ch03_dynamic_batching.png"
    png.write_bytes((TITLES_FILE.parent / png.name).read_bytes())
    manifest = {png.stem: {"titles": ["ch03: the batch sizes the server formed"],
                           "png_sha256": hashlib.sha256(png.read_bytes()).hexdigest()}}
    readme = tmp_path / "README.md"
    readme.write_text(f"![the batch sizes the server formed](figures/{png.name})\n")
    assert caption_problems(readme, manifest, figures) == []
    readme.write_text(f"![the batch sizes the server formed; the padding it computed](figures/{png.name})\n")
    assert ["the padding it computed" in problem for problem in caption_problems(readme, manifest, figures)] == [True]
    manifest[png.stem]["png_sha256"] = "0" * 64
    assert any("not the image" in problem for problem in caption_problems(readme, manifest, figures))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_NOTEBOOKS else n for n in sorted(OWN_RECORDINGS)])
def test_a_notebook_without_its_recordings_names_the_commands(name: str, tmp_path: Path):
    notebook = execute(notebook_paths([name])[0], {"SFS_RESULTS_DIR": str(tmp_path)})
    notes = "\n".join(_notes(notebook))
    assert _images(notebook) == 0 and len(_notes(notebook)) == _show_calls(notebook)
    for relative in OWN_RECORDINGS[name]:  # each missing file is named with the command that writes it
        assert f"--out {tmp_path / relative}" in notes, relative


def test_drain_plot_counts_what_the_timeline_holds():
    from benchmarks.report.notebook_plots import check_figure, plot_drain_timeline

    timeline = synthetic_drain_timeline(clients=3, exit_s=0.9)
    answered = [r for r in timeline["requests"] if r["status"] == 200]
    refused = [r for r in timeline["requests"] if r["status"] in (503, "no connection")]
    assert answered and refused and all(r["start_s"] < 0 for r in answered)  # the story the plot must tell
    figure = check_figure(plot_drain_timeline(timeline))
    titles = [ax.get_title() for ax in figure.axes]
    assert f"{len(timeline['requests'])} requests: {len(refused)} refused after the signal; 0 accepted before it " \
           "and not answered" in titles
    cut = {**timeline, "requests": [*timeline["requests"], {"start_s": -0.5, "end_s": 0.3, "status": "no connection"}]}
    assert any("1 accepted before it and not answered" in ax.get_title() for ax in plot_drain_timeline(cut).axes)


def test_leak_plot_draws_growth_from_the_warm_up():
    from benchmarks.report.notebook_plots import plot_leak_curves

    curves = {lesson: synthetic_leak_report(lesson, requests=1000, fail_share=0.2, leaked_mb_per_failure=0.5)
              for lesson in ("leaky", "fixed")}
    assert curves["leaky"]["leaking"] and not curves["fixed"]["leaking"]
    tensors = plot_leak_curves(curves).axes[0]
    lines = {line.get_label().split(":")[0]: line for line in tensors.lines}
    assert lines["leaky"].get_ydata()[-1] == pytest.approx(200 * 0.5)  # 200 failed requests x 0.5 MiB kept each
    assert max(abs(v) for v in lines["fixed"].get_ydata()) == 0


def test_show_refuses_an_empty_panel():
    from matplotlib.figure import Figure

    from benchmarks.report.notebook_plots import check_figure

    left, right = Figure().subplots(1, 2)
    left.plot([1, 2], [3, 4])
    right.set_title("nothing here")
    with pytest.raises(AssertionError, match="nothing here"):
        check_figure(left.figure)
    right.bar([1], [2])
    assert check_figure(left.figure) is left.figure
    with pytest.raises(AssertionError):
        check_figure(Figure())


@pytest.mark.slow  # the leak check itself runs on every run (tests/test_ch07_leakcheck.py)
def test_leakcheck_writes_its_memory_curve_where_the_notebook_reads_it(tmp_path: Path):
    from benchmarks.report.notebook_plots import load_leak_curves
    from chapters.ch07_production import leakcheck

    for lesson in ("leaky", "fixed"):
        leakcheck.main(["--requests", "20", "--warmup", "4", "--samples", "2", "--fail-share", "0.5",
                        "--leak-lesson", lesson, "--out", str(tmp_path / "ch07" / f"leak-{lesson}.json")])
    curves = load_leak_curves(tmp_path)
    for report in curves.values():
        assert [point["requests"] for point in report["series"]] == [0, 10, 20]
        assert report["series"][-1]["failed"] == report["failed"] > 0
    with pytest.raises(SystemExit):
        leakcheck.main(["--requests", "20", "--samples", "0", "--out", str(tmp_path / "bad.json")])


@pytest.mark.slow
def test_drain_recorder_against_a_real_server(tmp_path: Path):
    import json

    from benchmarks.studies.drain_timeline import drain_timeline
    from benchmarks.report.notebook_plots import check_figure, plot_drain_timeline

    out = tmp_path / "ch07" / "drain-timeline.json"
    assert drain_timeline.main(["--out", str(out), "--clients", "2", "--max-new-tokens", "16",
                                "--load-before-s", "1.5"]) == 0
    timeline = json.loads(out.read_text())
    assert timeline["exit_code"] == 0 and timeline["exit_s"] is not None
    before = [r for r in timeline["requests"] if r["start_s"] < 0]
    assert before and all(r["status"] == 200 for r in before)  # accepted before the signal: answered
    assert {r["status"] for r in timeline["requests"] if r["start_s"] > 0} <= {503, "no connection"}
    assert all(p["ready"] for p in timeline["polls"] if p["t_s"] < 0 and p["readyz_status"] is not None)
    assert not any(p["ready"] for p in timeline["polls"] if p["t_s"] > 0.2)
    check_figure(plot_drain_timeline(timeline))


def test_the_padding_plot_knows_chapter_3s_default_prefill():
    from benchmarks.report.notebook_plots import CH03_DEFAULT_PREFILL
    from chapters.ch03_dynamic_batching.server import BatchingSettings

    assert BatchingSettings.model_fields["prefill"].default == CH03_DEFAULT_PREFILL


def test_the_padding_plot_draws_what_the_runs_prefill_computed():
    """`by_length` computes no prompt padding; `padded` computes batch x longest prompt: the plot says which."""
    from benchmarks.report.notebook_plots import plot_padding
    from synthetic_results import rich_synthetic_result

    by_length = rich_synthetic_result("ch03")
    config = by_length.config.model_copy(update={"server_args": [*by_length.config.server_args, "--prefill=padded"]})
    padded = by_length.model_copy(update={"config": config})
    for result, title, note in ((by_length, "--prefill by_length", "0% computed"), (padded, "--prefill padded", "padding computed")):
        ax = plot_padding(result).axes[0]
        assert title in ax.get_title()
        assert all(note in text.get_text() for text in ax.texts) and ax.texts
