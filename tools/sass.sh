#!/bin/bash
# The sm_90a machine code of one kernel source, here (no GPU): register use, spills and ptxas's remarks
# (e.g. C7517, a `wgmma` wait the compiler injected) for every entry, and the SASS of the entries whose
# name matches a pattern, so a kernel change can be read before any device time is spent on it.
#
#   bash tools/sass.sh kernels/quant_gemm.cu [ENTRY_REGEX] [OUT_DIR]
#
# Prints ptxas's summary of each entry; with ENTRY_REGEX (e.g. '^qgemm_wg_q8_0$') writes each matching
# entry's SASS to OUT_DIR/<entry>.sass (default OUT_DIR: /tmp/sass) and prints its instruction count and
# its `wgmma` waits (`WARPGROUP.DEPBAR`), local-memory spills (`STL`/`LDL`) and barrier waits.
#
# nvcc comes from ../shared/tools/cuda-env.sh (or $CUDA_ENV); nvdisasm, which the CUDA wheels of that
# script do not carry, from the PyPI wheel `nvidia-cuda-nvdisasm`, downloaded once into
# ~/.cache/prism-cuda/nvdisasm (pip download; it reads the cubins of CUDA 13.0's ptxas).
set -euo pipefail
src=${1:?usage: tools/sass.sh KERNEL.cu [ENTRY_REGEX] [OUT_DIR]}
pattern=${2:-}
out=${3:-/tmp/sass}
if ! command -v nvcc > /dev/null; then
    # shellcheck source=/dev/null
    . "${CUDA_ENV:-../shared/tools/cuda-env.sh}"
fi
mkdir -p "$out"
cubin="$out/$(basename "$src" .cu).cubin"
nvcc -O3 -cubin -arch=sm_90a -lineinfo -Xptxas -v "$src" -o "$cubin" 2>&1 \
    | grep -E "Compiling entry|registers|spill|C7517" || true
[ -n "$pattern" ] || exit 0

tools="${HOME}/.cache/prism-cuda/nvdisasm"
nvdisasm=$(find "$tools" -name nvdisasm -type f 2>/dev/null | head -1 || true)
if [ -z "$nvdisasm" ]; then
    mkdir -p "$tools"
    python3 -m pip download -q --no-deps -d "$tools" nvidia-cuda-nvdisasm
    (cd "$tools" && python3 -m zipfile -e ./*.whl .)
    nvdisasm=$(find "$tools" -name nvdisasm -type f | head -1)
    chmod +x "$nvdisasm"
fi
all="$out/$(basename "$src" .cu).sass"
"$nvdisasm" -c "$cubin" > "$all"
# Each entry's text section, by name.
grep -oE '^//-+ \.text\.[A-Za-z0-9_]+' "$all" | sed 's/.*\.text\.//' | grep -E "$pattern" | while read -r entry; do
    awk -v e="$entry" '
        /^\/\/-+ \.text\./ { on = ($0 ~ ("\\.text\\." e "( |$)")) }
        on { print }
    ' "$all" > "$out/$entry.sass"
    f="$out/$entry.sass"
    printf '%s: %d instructions, %d wgmma waits, %d spill loads/stores, %d mbarrier waits -> %s\n' \
        "$entry" "$(grep -cE '^\s+/\*[0-9a-f]{4,}\*/' "$f")" "$(grep -c 'WARPGROUP.DEPBAR' "$f")" \
        "$(grep -cE '\b(STL|LDL)\b' "$f")" "$(grep -c 'SYNCS.PHASECHK' "$f")" "$f"
done
