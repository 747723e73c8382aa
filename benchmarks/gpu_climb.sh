#!/usr/bin/env bash
# The GPU figures in one command, sized for a 10-minute lease of a CUDA machine that already has a
# CUDA build of torch and this project's dependencies: the climb on the gpu profile, then chapter 5's
# trade-off table on CUDA. Everything lands in OUTDIR, and OUTDIR.tgz packs it.
#
#   bash benchmarks/gpu_climb.sh OUTDIR
#
# Each step has its own time limit, so a step that hangs cannot take the others' results with it.
# To commit the climb as the reference: cp OUTDIR/climb/ch0?.json benchmarks/reference/gpu/ &&
#   python -m benchmarks report --profile gpu --reference && python -m benchmarks readme
set -u
out=${1:?usage: bash benchmarks/gpu_climb.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
started=$(date +%s)
step() { echo "== $(( $(date +%s) - started )) s: $*"; }

pack() { tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"; }
trap pack EXIT

step "machine"
{ nvidia-smi; "$python" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; } \
  > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

step "climb, gpu profile (at most ${CLIMB_LIMIT_S:=430} s)"
timeout "$CLIMB_LIMIT_S" "$python" -m benchmarks climb --profile gpu --out "$out/climb" 2>&1 | tee "$out/climb.log"
# A climb stopped by its limit has written the chapters it finished; draw the table from those.
"$python" -m benchmarks report --profile gpu --out "$out/climb" > "$out/report.log" 2>&1 || true

step "trade-off table on CUDA, tiny default model (at most ${TRADEOFFS_LIMIT_S:=75} s)"
timeout "$TRADEOFFS_LIMIT_S" "$python" -m chapters.ch05_inference_engine.tradeoffs --device cuda \
  --engines eager onnxruntime tensorrt --out "$out/tradeoffs" 2>&1 | tee "$out/tradeoffs.log"

step "done"
