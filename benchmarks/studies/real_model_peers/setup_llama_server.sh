#!/usr/bin/env bash
# Build llama.cpp's own C++ server, llama-server, apart from the project.
#
# Where the sources come from: PyPI's llama-cpp-python sdist vendors llama.cpp
# (tools/server/ among it). Its Python server handles one request at a time, so
# it is not the peer; the C++ server, built here from the same sources, batches
# every slot's tokens into one step (continuous batching).
#
# Usage: bash benchmarks/studies/real_model_peers/setup_llama_server.sh [BUILD_DIR]
#   BUILD_DIR defaults to .llama-cpp at the repository root (ignored by git).
#   LLAMA_CPP_PYTHON_VERSION picks the sdist (default 0.3.36).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
build_root="${1:-$repo_root/.llama-cpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
python_bin="${PYTHON:-$repo_root/.venv/bin/python}"

mkdir -p "$build_root"
sdist="$build_root/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    "$python_bin" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$build_root"
fi
src="$build_root/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -d "$src" ]; then
    tar -xzf "$sdist" -C "$build_root"
fi
# Built for this CPU's own vector instructions, as a user building it on their
# machine would, named one by one from /proc/cpuinfo rather than -march=native:
# native builds ggml's AMX kernels where the CPU lists AMX, and on the Xeon this
# study ran on they die of SIGILL at their first tile instruction (tilezero),
# permission to use the tiles granted or not. No web UI (it would be fetched),
# no tests or examples.
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { case "$cpu_flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
cmake -S "$src" -B "$build_root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_SSE42="$(has sse4_2)" -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" \
    -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)" \
    -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" \
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$build_root/build" --target llama-server -j "$(nproc)"
"$build_root/build/bin/llama-server" --version
echo "llama-server ready: $build_root/build/bin/llama-server"
