#!/usr/bin/env bash
# The GPU figures in one command, sized for a 10-minute lease of a CUDA machine that already has a
# CUDA build of torch and this project's dependencies (nvidia-ml-py too: the harness samples GPU
# utilisation with it at every level). Steps, each under its own time limit so one that hangs
# cannot take the others' results with it:
#
#   1. the machine (nvidia-smi, torch, CUDA);
#   1a. the tests that skip without CUDA (CUDA_TESTS), their output the evidence (tests-cuda.txt);
#   1b. chapter 8's decode step eager and recorded (benchmarks/studies/gpu_step, gpu_step.txt);
#   2. chapter 5's auto engine choice, measured once on the gpu profile's model, so the chapters
#      that build an engine (ch05 on) read it from the engine cache instead of measuring at start-up;
#   3. the gpu profile, one chapter at a time, for every chapter in chapters.CHAPTERS;
#   4. the table and plots from whatever chapters finished, and GPU utilisation per level beside the
#      article's (gpu_util.txt);
#   5. the trade-off table on CUDA (python -m benchmarks.harness.tradeoffs).
#
# Everything lands in OUTDIR, and OUTDIR.tgz packs it (also when a step fails or the lease ends).
#
#   bash benchmarks/harness/gpu_climb.sh OUTDIR
#
# A lent machine with no package index gets what its image lacks as wheels (gpu_wheels.txt), fetched here:
#   echo /.whl/ >> .git/info/exclude; grep -v '^#' benchmarks/harness/gpu_wheels.txt | xargs python3 -m pip download \
#     --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
# and installed there first: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD
#
# Limits (seconds, environment): TESTS_LIMIT_S, STEP_LIMIT_S, CHOICE_LIMIT_S, CHAPTER_LIMIT_S (each chapter),
# CH08_LIMIT_S, TRADEOFFS_LIMIT_S (TESTS=0, STEP=0, CHOICE=0, TRADEOFFS=0 skip those steps); CHAPTERS=ch04,ch05 runs only those, in that
# order. Every step at its limit is about 22 minutes for eight chapters: more than one 10-minute command,
# so a lease runs it in two (CHAPTERS split between them).
# To commit the climb as the reference: cp OUTDIR/climb/ch0?.json benchmarks/reference/gpu/ &&
#   python -m benchmarks report --profile gpu --reference && python -m benchmarks readme
set -u
out=${1:?usage: bash benchmarks/harness/gpu_climb.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
started=$(date +%s)
step() { echo "== $(( $(date +%s) - started )) s: $*"; }
# SIGINT first: the harness stops the chapter server it started on KeyboardInterrupt; KILL 15 s later.
limited() { local limit=$1; shift; timeout -s INT -k 15 "$limit" "$@"; }

pack() { tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"; }
trap pack EXIT

step "machine"
{ nvidia-smi; "$python" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
  "$python" -c "import pynvml; print('nvidia-ml-py', pynvml.__version__ if hasattr(pynvml, '__version__') else 'present')" \
    || echo "nvidia-ml-py missing: no GPU utilisation will be recorded (pip install nvidia-ml-py)"; } \
  > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

if [ "${TESTS:-1}" != 0 ]; then
step "the tests that need CUDA (at most ${TESTS_LIMIT_S:=150} s)"
# They skip where torch sees no GPU; here they run, and their output is the evidence.
limited "$TESTS_LIMIT_S" "$python" -m pytest -q -rs -p no:cacheprovider --timeout 120 ${CUDA_TESTS:-tests/test_ch05_cudagraph.py \
  tests/test_ch08_cuda_graphs.py} > "$out/tests-cuda.txt" 2>&1
echo "exit $?"; tail -n 15 "$out/tests-cuda.txt"
fi

if [ "${STEP:-1}" != 0 ]; then
step "chapter 8's decode step on the GPU: eager or recorded (at most ${STEP_LIMIT_S:=120} s)"
limited "$STEP_LIMIT_S" "$python" -m benchmarks.studies.gpu_step.step_profile --out "$out/gpu_step.txt" > "$out/gpu_step.log" 2>&1
echo "exit $?"; head -n 14 "$out/gpu_step.log"; tail -n 5 "$out/gpu_step.log"
fi

if [ "${CHOICE:-1}" != 0 ]; then  # CHOICE=0: a warm machine that measured it already
step "auto engine choice on the gpu profile's model (at most ${CHOICE_LIMIT_S:=75} s)"
# Same weights, device and thread count as the chapter servers, so the cached choice's key matches.
limited "$CHOICE_LIMIT_S" "$python" - "${SFS_BENCH_WEIGHTS:-smollm2}" > "$out/engine_choice.log" 2>&1 <<'EOF'
import json, logging, sys
import torch
logging.basicConfig(level=logging.INFO)
torch.set_num_threads(1)
from chapters.ch05_inference_engine.engines import choose_default
from shared.weights import load_model
model = load_model(sys.argv[1], device="cuda").model
print(json.dumps({"chosen": choose_default(model)}))
EOF
tail -n 20 "$out/engine_choice.log"
fi

chapters=${CHAPTERS:-$("$python" -c "from chapters import CHAPTERS; print(','.join(CHAPTERS))")}
for chapter in ${chapters//,/ }; do
  # Chapter 8's first start compiles flex attention for each bucket of rows and records its decode graphs.
  limit=${CHAPTER_LIMIT_S:=50}; [ "$chapter" = ch08 ] && limit=${CH08_LIMIT_S:=150}
  step "climb, gpu profile, $chapter (at most $limit s)"
  limited "$limit" "$python" -m benchmarks climb --profile gpu --chapters "$chapter" --out "$out/climb" \
    > "$out/climb-$chapter.log" 2>&1
  echo "exit $? (124: stopped by its limit)"; tail -n 8 "$out/climb-$chapter.log"
done

step "table, plots and GPU utilisation per level"
"$python" -m benchmarks report --profile gpu --out "$out/climb" > "$out/report.log" 2>&1 || true
tail -n 30 "$out/report.log"
"$python" - "$out/climb" > "$out/gpu_util.txt" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
from benchmarks.harness.article import ARTICLE
print(f"{'chapter':8} {'users':>5} {'QPS':>8} {'P99 s':>7} {'GPU %':>6}   article: QPS, P99 s, GPU %")
for path in sorted(Path(sys.argv[1]).glob("ch*.json")):
    result = json.loads(path.read_text())
    chapter, article = result["chapter"], ARTICLE.get(result["chapter"])
    cited = f"{article.qps:g}, {article.p99_s:g}, {article.gpu_util_percent:g}" if article else "-"
    for level in result["levels"]:
        p99 = (level.get("latency_ms") or {}).get("p99")
        util = level.get("gpu_util_percent_mean")
        print(f"{chapter:8} {level['users']:>5} {level['qps']:>8.1f} {p99 / 1e3 if p99 else float('nan'):>7.3f} "
              f"{util if util is not None else float('nan'):>6.1f}   {cited}")
EOF
cat "$out/gpu_util.txt"

[ "${TRADEOFFS:-1}" = 0 ] && { step "done (trade-off table skipped)"; exit 0; }
step "trade-off table on CUDA, tiny default model (at most ${TRADEOFFS_LIMIT_S:=80} s)"
limited "$TRADEOFFS_LIMIT_S" "$python" -m benchmarks.harness.tradeoffs --device cuda \
  --engines eager cudagraph onnxruntime tensorrt --out "$out/tradeoffs" > "$out/tradeoffs.log" 2>&1
echo "exit $?"; tail -n 30 "$out/tradeoffs.log"

step "done"
