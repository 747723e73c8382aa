"""`make setup` (scripts/setup_venv.sh): the project's own environment from whatever Python the user names.

A stand-in interpreter (a script answering the setup's questions as an old or incomplete Python would)
checks each refusal: one line on stderr that says what to install, exit status 2, nothing made.
The real path (a fresh .venv from a distribution's, pyenv's or conda's Python) is what `.ci/run` runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup_venv.sh"


def stand_in_python(tmp_path: Path, version: str, has_venv: bool = True) -> Path:
    """A stand-in interpreter: this Python, told it is ``version`` (and without ``ensurepip`` if asked),
    running the setup's own ``-c`` code, so the script's checks are what is tested."""
    major, minor, micro = (int(part) for part in version.split("."))
    prelude = f"import sys; sys.version_info = ({major}, {minor}, {micro}, 'final', 0); sys.version = '{version}' + sys.version[sys.version.index(' '):]"
    if not has_venv:
        prelude += "; sys.modules['ensurepip'] = None"
    script = tmp_path / "python"
    script.write_text(f'#!/usr/bin/env bash\n[ "$1" = -c ] || exit 1\nexec {sys.executable} -c "{prelude}"$\'\\n\'"$2"\n')
    script.chmod(0o755)
    return script


def setup(python: str | Path, venv: Path, chosen: str = "1") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP), str(python), str(venv), "torch==2.13.0", chosen], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ})


@pytest.mark.parametrize(("version", "has_venv", "says"), [
    ("3.10.13", True, "supports Python 3.11 to 3.13"),
    ("3.14.0", True, "supports Python 3.11 to 3.13"),
    ("3.12.3", False, "apt-get install python3-venv"),
])
def test_an_unfit_interpreter_gets_one_line_saying_what_to_install_and_exit_2(tmp_path, version, has_venv, says) -> None:
    venv = tmp_path / "venv"
    done = setup(stand_in_python(tmp_path, version, has_venv), venv)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("setup: ") and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not venv.exists()


def test_a_missing_interpreter_is_named_in_one_line(tmp_path) -> None:
    done = setup(tmp_path / "no-such-python", tmp_path / "venv")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "cannot run" in done.stderr, done.stderr


def test_a_complete_environment_is_used_as_it_is_unless_another_interpreter_is_named(tmp_path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(stand_in_python(tmp_path, "3.11.7"), venv / "bin" / "python")
    (venv / ".setup-complete").touch()
    os.utime(venv / ".setup-complete", (2**31, 2**31))  # newer than pyproject.toml: nothing to reinstall
    unnamed = setup(tmp_path / "no-such-python", venv, chosen="0")
    assert unnamed.returncode == 0 and unnamed.stdout == unnamed.stderr == "", unnamed
    other = tmp_path / "other"
    other.mkdir()
    named = setup(stand_in_python(other, "3.10.2"), venv, chosen="1")  # named, different, and too old
    assert named.returncode == 2 and "supports Python 3.11 to 3.13" in named.stderr, named
