"""How a generated block names a file or a command: from the repository's root, in today's layout.

A results file records the command that made it, as it was typed then. Since then ``benchmarks/``
was arranged into ``harness/``, ``report/`` and ``studies/``; :func:`current_command` rewrites a
recorded command to the module and folder names of today, so the block's "Reproduce" still runs.
The files themselves are left as they were recorded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from benchmarks.harness.results import REPO_ROOT

# Old path or module -> today's, for what moved when benchmarks/ was split into packages.
STUDY_FOLDERS = {
    "benchmarks/reference/cpu/ch07/shell-refactor": "benchmarks/studies/ch07_shell_refactor",
    "benchmarks/reference/cpu/ch08/event-loop": "benchmarks/studies/event_loop",
    "benchmarks/reference/cpu/ch08/kernel-floor": "benchmarks/studies/kernel_floor",
    "benchmarks/reference/cpu/ch08/kernel-prefetch": "benchmarks/studies/kernel_prefetch",
    "benchmarks/reference/cpu/ch08/linear-eviction": "benchmarks/studies/linear_eviction",
    "benchmarks/reference/cpu/ch08/shell": "benchmarks/studies/ch08_shell",
    "benchmarks/reference/cpu/ch08/stalls": "benchmarks/studies/stream_stalls",
    "benchmarks/reference/cpu/ch08/step-floor": "benchmarks/studies/step_floor",
    **{f"benchmarks/reference/cpu/ch08/prefix-caching/ttft-split-caching-{state}.txt":
       f"benchmarks/studies/ttft_split/ttft-split-caching-{state}.txt" for state in ("on", "off")},
}
HARNESS_MODULES = ("article", "calibration", "ceiling", "environment", "loadgen", "locustfile", "profiles", "results",
                   "server_process", "server_stats", "streaming", "tradeoffs", "trivial_server", "workload")
STUDY_MODULES = {  # module -> its study's folder
    "kv_share": "kv_share", "ttft_split": "ttft_split", "decode_attention": "decode_attention",
    "live_page_cost": "live_page_cost", "drain_timeline": "drain_timeline", "scale_out_timeline": "scale_out_timeline",
    "profile_ch08": "ch08_step_profile", "scale_out_compare": "replicas_and_routers",
}
MODULES = {
    **{name: f"harness.{name}" for name in HARNESS_MODULES},
    "harness": "harness.climb", "sampling": "harness.resource_sampler",
    "readme_blocks": "report.readme_blocks", "notebook_plots": "report.notebook_plots", "reference": "report.reference",
    **{name: f"studies.{folder}.{name}" for name, folder in STUDY_MODULES.items()},
}
SCRIPTS = {"gpu_climb.sh": "harness/gpu_climb.sh", "compare_commits.sh": "harness/compare_commits.sh",
           "kv_share.sh": "studies/kv_share/kv_share.sh"}
MOVED = {
    **STUDY_FOLDERS,
    **{f"benchmarks/{old}": f"benchmarks/{new}" for old, new in SCRIPTS.items()},
    **{f"benchmarks/{old}.py": "benchmarks/" + new.replace(".", "/") + ".py" for old, new in MODULES.items()},
    **{f"benchmarks.{old}": f"benchmarks.{new}" for old, new in MODULES.items()},
    "benchmarks/notebook_plots.py": "benchmarks/report/notebook_plots/",  # a package now
    "benchmarks/report.py": "benchmarks/report/",  # a package now
    "benchmarks/synthetic.py": "tests/synthetic_results.py",
    # Chapter 9's simulation keeps the model; its driver is a study (one command per step of it).
    "chapters.ch09_scale_out.simulation run": "benchmarks.studies.scale_out_simulation.sweep",
    "chapters.ch09_scale_out.simulation measure": "benchmarks.studies.scale_out_simulation.measure_steps",
}
# One pass over the text, the longest old name first; a name is whole only where no name character
# follows it (``benchmarks.harness`` is the old module, ``benchmarks.harness.climb`` is not).
_OLD_NAME = re.compile("(" + "|".join(re.escape(old) for old in sorted(MOVED, key=len, reverse=True))
                       + r")(?![A-Za-z0-9_-])(?!\.[A-Za-z_])")


def current_command(command: str) -> str:
    """``command`` as recorded, with every module and folder that moved since named as it is today."""
    return _OLD_NAME.sub(lambda match: MOVED[match[1]], command)


def relative_path(target: Path, readme: Path) -> str:
    return Path(os.path.relpath(target, readme.parent)).as_posix()


def repo_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()
