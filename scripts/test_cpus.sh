#!/usr/bin/env bash
# `make test-cpus`: the numerically sensitive tests once per CPU capability this machine can stand in for.
# torch chooses its vectorised kernels by the machine's instruction set; ATEN_CPU_CAPABILITY makes it
# choose as a machine with less would, ONEDNN_MAX_CPU_ISA does the same for oneDNN's matrix products and
# MKL_ENABLE_INSTRUCTIONS for MKL's. A test that passes only under one of them depends on a machine's
# rounding, not on the code.
#
#   scripts/test_cpus.sh PYTHON TEST_FILE...       (CPU_CAPABILITIES="default avx2" to choose; "below": the one
#                                                   capability under this machine's best, what `make test` runs)
set -uo pipefail
python=$1; shift
best=$("$python" -c 'import torch; print(torch.backends.cpu.get_cpu_capability().lower())')
case "$best" in
    avx512*) all="default avx2 avx512" ;;
    avx2) all="default avx2" ;;
    *) all="default" ;;  # other architectures: only torch's portable kernels can be asked for by name
esac
capabilities=${CPU_CAPABILITIES:-$all}
if [ "$capabilities" = below ]; then
    capabilities=$(echo "$all" | awk 'NF > 1 {print $(NF-1)}')
    [ -n "$capabilities" ] || { echo "test-cpus: this machine ($best) runs torch's portable kernels already: no capability below it"; exit 0; }
fi
declare -A onednn=([default]=SSE41 [avx2]=AVX2 [avx512]=ALL) mkl=([default]=SSE4_2 [avx2]=AVX2 [avx512]=AVX512)
summary=() status=0
for cap in $capabilities; do
    case " $all " in *" $cap "*) ;; *) echo "test-cpus: this machine ($best) cannot stand in for $cap; it can for: $all" >&2; exit 2 ;; esac
    export ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=${onednn[$cap]} MKL_ENABLE_INSTRUCTIONS=${mkl[$cap]}
    chosen=$("$python" -c 'import torch; print(torch.backends.cpu.get_cpu_capability().lower())')
    [ "$chosen" = "$cap" ] || { echo "test-cpus: asked torch for $cap, it runs $chosen" >&2; exit 2; }
    echo "== test-cpus: ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS"
    if "$python" -m pytest -q -p no:cacheprovider "$@"; then summary+=("$cap: passed"); else summary+=("$cap: FAILED"); status=1; fi
done
printf 'test-cpus: %s\n' "${summary[@]}"
exit $status
