"""How a generated block names a file or a command: from the repository's root, in today's layout.

A results file records the command that made it as it was typed, with the module and folder names of
its day; :func:`current_command` names every one that :data:`MOVED` lists as it is now, so a block's
"Reproduce" runs. The files keep the command as recorded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from benchmarks.harness.results import REPO_ROOT

# A module or folder as the committed results' commands name it -> today's.
MOVED = {
    "benchmarks.decode_attention": "benchmarks.studies.decode_attention.decode_attention",
    "benchmarks.drain_timeline": "benchmarks.studies.drain_timeline.drain_timeline",
    "benchmarks.live_page_cost": "benchmarks.studies.live_page_cost.live_page_cost",
    "benchmarks.profile_ch08": "benchmarks.studies.ch08_step_profile.profile_ch08",
    "benchmarks.scale_out_timeline": "benchmarks.studies.scale_out_timeline.scale_out_timeline",
    "benchmarks.streaming": "benchmarks.harness.streaming",
    "benchmarks/reference/cpu/ch08/event-loop": "benchmarks/studies/event_loop",
    "chapters.ch09_scale_out.simulation run": "benchmarks.studies.scale_out_simulation.sweep",
    "chapters.ch09_scale_out.simulation measure": "benchmarks.studies.scale_out_simulation.measure_steps",
}
# One pass over the text, the longest name first; a name is whole only where no name character follows
# it, nor a dot and a name (``benchmarks.streaming`` is a module here, in ``benchmarks.streaming.x`` it is not).
_OLD_NAME = re.compile("(" + "|".join(re.escape(old) for old in sorted(MOVED, key=len, reverse=True))
                       + r")(?![A-Za-z0-9_-])(?!\.[A-Za-z_])")


def current_command(command: str) -> str:
    """``command`` as recorded, every module and folder of :data:`MOVED` named as it is today."""
    return _OLD_NAME.sub(lambda match: MOVED[match[1]], command)


def relative_path(target: Path, readme: Path) -> str:
    return Path(os.path.relpath(target, readme.parent)).as_posix()


def repo_path(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()
