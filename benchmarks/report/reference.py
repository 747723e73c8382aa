"""Reference results: runs copied to ``benchmarks/reference/<profile>/`` to be committed with their environment.

The notebooks and the READMEs read only these, so they have data on a fresh clone and a learner can
compare a run of their own with them. The report (table and plots) is regenerated there from every
reference JSON of the profile, so a chapter saved alone joins the ones already saved.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.results import OPEN_LOOP_DIR, REFERENCE_ROOT, load_open_loop_result, load_result
from benchmarks.report import ReportFiles, write_report


def save_reference(result_files: Sequence[Path], profile: str, reference_root: Path = REFERENCE_ROOT,
                   allow_dirty: bool = False) -> list[ReportFiles]:
    """Copy ``result_files`` (validated) to ``<reference_root>/<profile>/`` (open-loop sweeps to its
    ``openloop/``) and rewrite the report there. A result measured on a tree that differed from its
    commit is refused (ValueError) unless ``allow_dirty``: the reference must name code that exists.

    Returns the regenerated report of every workload the copied files belong to.
    """
    destination = reference_root / profile
    destination.mkdir(parents=True, exist_ok=True)
    workloads = set()
    for path in result_files:
        try:  # never commit a file that does not match the schema
            result, target = load_result(path), destination
        except ValueError:
            result, target = load_open_loop_result(path), destination / OPEN_LOOP_DIR  # an open-loop sweep
        if result.profile != profile:
            raise ValueError(f"{path} is a {result.profile!r} result, not {profile!r}")
        if result.environment.git_dirty and not allow_dirty:
            # A reference names the code it measured: a commit a reader can check out, not a working tree since gone.
            raise ValueError(f"{path} was measured on a working tree that differed from commit "
                             f"{(result.environment.git_commit or '?')[:10]}: commit first, then measure")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / Path(path).name)
        workloads.add(result.workload)
    return [write_report(destination, workload) for workload in sorted(workloads)]
