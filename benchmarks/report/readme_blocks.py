"""Rewrite the measured-results blocks of the READMEs from the committed results.

A README (or a RESULTS.md) marks where figures go, and never holds a hand-written number:

    <!-- results:ch03 -->
    (generated: ch03 against ch02, the ratio, the command that reproduces it, the file it came from)
    <!-- /results -->

Keys: ``climb`` (the whole table and the plots, for the main README), a chapter id (``ch03``: that
chapter against the previous measured chapter), or a variant's label (``ch01-workers``: the variant
against its own chapter), or the name of a study's or a comparison's block (:func:`render_key`). A key
may name its profile, ``climb@gpu``; otherwise the command's ``--profile`` (default ``cpu``) applies.
``python -m benchmarks readme`` rewrites every block of :func:`default_readmes`; text outside the
markers is left byte for byte. The blocks themselves: ``climb_blocks`` (the harness's climb and
runs), ``streaming_blocks`` (servers compared by the streaming client), ``study_blocks`` (the
studies), ``scale_out_blocks`` (chapter 9), ``peer_blocks`` (other servers beside chapter 8).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from benchmarks.harness.results import REFERENCE_ROOT, REPO_ROOT, STUDIES_ROOT, BenchmarkResult, load_results
from benchmarks.harness.workload import WORKLOADS
from benchmarks.report.climb_blocks import (
    PARTIAL_CLIMBS,
    TWO_MODELS,
    climb_block,
    comparison_block,
    machines_block,
    partial_climb_block,
    previous_result,
    two_models_block,
)
from benchmarks.report.peer_blocks import real_model_engine_loops_block, real_model_peers_block, vllm_peer_block
from benchmarks.report.scale_out_blocks import (
    autoscale_block,
    ceilings_block,
    drill_block,
    replicas_block,
    serve_path_cost_block,
    simulation_block,
)
from benchmarks.report.streaming_blocks import (
    ch08_targets_block,
    deploy_block,
    prefix_caching_block,
    side_by_side_block,
    stream_interval_block,
    streaming_block,
)
from benchmarks.report.study_blocks import (
    decode_attention_block,
    event_loop_block,
    kv_share_block,
    live_page_cost_block,
    packed_step_profile_block,
    sampling_block,
    study_file_block,
)


BLOCK = re.compile(r"(?P<open><!-- results:(?P<key>[A-Za-z0-9_.@/:\-]+) -->)(?P<body>.*?)(?P<close><!-- /results -->)", re.S)


def rewrite_blocks(text: str, render: Callable[[str], str]) -> str:
    """``text`` with every block's body replaced by ``render(key)``; markers and the rest untouched."""

    def replace(match: re.Match) -> str:
        return f"{match['open']}\n{render(match['key']).strip()}\n{match['close']}"

    return BLOCK.sub(replace, text)


def block_keys(text: str) -> list[str]:
    return [match["key"] for match in BLOCK.finditer(text)]


def render_key(key: str, results: Mapping[str, BenchmarkResult], directory: Path, readme: Path, profile: str) -> str:
    if key.endswith("-live-page-cost"):
        return live_page_cost_block(directory, key.removesuffix("-live-page-cost"))
    if key == "ch09-simulation":
        return simulation_block(directory)
    if key == "ch09-ceiling":
        return ceilings_block(directory)
    if key == "ch09-drill":
        return drill_block(directory)
    if key == "ch09-autoscale":
        return autoscale_block(directory)
    if key == "ch09-replicas":
        return replicas_block(directory)
    if key.startswith("ch09-serve-path-cost-"):  # ch09-serve-path-cost-mixed: CPU per answer, from serve-path-mixed.json
        return serve_path_cost_block(directory, key.removeprefix("ch09-serve-path-cost-"))
    if key.startswith("ch09-serve-path-"):  # ch09-serve-path-mixed: serve-path-mixed.json, against its first row (chapter 8 alone)
        return replicas_block(directory, f"{key.removeprefix('ch09-')}.json", against=None)
    if key.startswith("real-model-peers"):  # real-model-peers, real-model-peers-avx2: one folder per kind of core
        return real_model_peers_block(directory, key)
    if key == "real-model-engine-loops":
        return real_model_engine_loops_block(directory)
    if key.startswith("vllm-peer"):  # vllm-peer, vllm-peer-avx512: one folder of files per kind of core
        return vllm_peer_block(directory, key)
    if key.startswith("side-by-side"):  # side-by-side, side-by-side-avx2: one folder of rounds per machine
        return side_by_side_block(directory, key)
    if key == "deploy":
        return deploy_block(directory)
    if key == "ch08-event-loop":
        return event_loop_block(STUDIES_ROOT / "event_loop")
    if key == "ch08-targets":
        return ch08_targets_block(directory)
    if key == "ch08-stream-interval":
        return stream_interval_block(directory)
    if key == "packed-step-profile":
        return packed_step_profile_block(directory)
    if key == "kv-share":
        return kv_share_block(directory)
    if key == "ch08-prefix-caching":
        return prefix_caching_block(directory)
    if key.startswith("ch08-decode-attention"):  # ch08-decode-attention-avx2: the folder decode-attention-avx2
        return decode_attention_block(directory, "" if key == "ch08-decode-attention" else key.removeprefix("ch08-"))
    if key == "ch08-sampling":
        return sampling_block(directory)
    if key == "streaming":
        return streaming_block(directory)
    if key == "machines":
        previous = REFERENCE_ROOT / "cpu-previous"
        return machines_block(results, load_results(previous, "default") if previous.exists() else {})
    if key == "climb":
        return climb_block(results, directory, readme, profile)
    if key in TWO_MODELS:
        return two_models_block(TWO_MODELS[key], readme)
    if key in PARTIAL_CLIMBS:
        folder, how = PARTIAL_CLIMBS[key]
        return partial_climb_block(REFERENCE_ROOT / "cpu" / folder, how, readme)
    if key in results:
        return comparison_block(results[key], previous_result(key, results), directory, readme, profile)
    if re.fullmatch(r"ch\d\d", key):
        command = f"python -m benchmarks run --chapter {key} --profile {profile} --save-reference"
    else:  # a variant: its flags live in the chapter's README, next to this block
        command = f"python -m benchmarks run --chapter chNN --profile {profile} --server-arg=... --label {key} --save-reference"
    return f"*No reference result for `{key}` on the `{profile}` profile yet: `{command}` records one.*"


# ``<!-- results:study:kernel_floor/results.txt -->``: that file of benchmarks/studies/, as committed.
STUDY_FILE_PREFIX = "study:"


def default_readmes() -> list[Path]:
    """Every page that may hold results blocks (those that exist): the front README and the harness's
    RESULTS.md, each chapter's lesson and its RESULTS.md, each study's README."""
    pages = [REPO_ROOT / "README.md", REPO_ROOT / "benchmarks" / "RESULTS.md"]
    for chapter in sorted((REPO_ROOT / "chapters").glob("ch*/")):
        pages += [chapter / "README.md", chapter / "RESULTS.md"]
    pages += sorted(STUDIES_ROOT.glob("*/README.md"))
    return [page for page in pages if page.exists()]


def split_key(key: str, default_profile: str) -> tuple[str, str]:
    """``climb@gpu`` -> ``("climb", "gpu")``; ``ch03`` -> ``("ch03", default_profile)``."""
    name, _, profile = key.partition("@")
    return name, profile or default_profile


def split_workload(name: str) -> tuple[str, str]:
    """``ch04-long`` -> ``("ch04", "long")``: a block of a non-default workload's results (a workload's name
    may hold hyphens: ``ch08-shared-prefix``); else the default."""
    for workload in WORKLOADS:
        label = name.removesuffix(f"-{workload}")
        if workload != "default" and label and label != name:
            return label, workload
    return name, "default"


def rewritten_readmes(
    readmes: Sequence[Path] | None = None, profile: str = "cpu", directory: Path | None = None
) -> dict[Path, str]:
    """The pages among ``readmes`` whose blocks the reference results would change, with their new text.

    Each block reads ``<reference>/<profile>/``, its key's profile or ``profile`` (``directory``
    overrides where they are). Nothing is written; an empty answer means every page is up to date.
    """
    loaded: dict[tuple[Path, str], dict[str, BenchmarkResult]] = {}

    def results_in(where: Path, workload: str) -> dict[str, BenchmarkResult]:
        if (where, workload) not in loaded:
            loaded[where, workload] = load_results(where, workload) if where.exists() else {}
        return loaded[where, workload]

    def render(key: str, readme: Path) -> str:
        if key.startswith(STUDY_FILE_PREFIX):  # a study's own text results, wherever the page is
            return study_file_block(STUDIES_ROOT / key.removeprefix(STUDY_FILE_PREFIX))
        name, block_profile = split_key(key, profile)
        label, workload = split_workload(name)
        where = directory if directory is not None and block_profile == profile else REFERENCE_ROOT / block_profile
        return render_key(label, results_in(where, workload), where, readme, block_profile)

    changed = {}
    for readme in readmes if readmes is not None else default_readmes():
        if not readme.exists():
            continue
        text = readme.read_text()
        updated = rewrite_blocks(text, lambda key, readme=readme: render(key, readme))
        if updated != text:
            changed[readme] = updated
    return changed


def update_readmes(
    readmes: Sequence[Path] | None = None, profile: str = "cpu", directory: Path | None = None
) -> list[Path]:
    """Rewrite the blocks of ``readmes`` (:func:`rewritten_readmes`); returns the files that changed."""
    changed = rewritten_readmes(readmes, profile, directory)
    for readme, text in changed.items():
        readme.write_text(text)
    return list(changed)
