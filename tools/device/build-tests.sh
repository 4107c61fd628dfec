#!/bin/bash
# Builds the device checks (tests/device, one test binary) here, for the GPU machine: a release build
# with the `cuda` feature, stripped and compressed into .device-carry/device-tests.xz, which
# `tools/device/run.sh checks` unpacks and runs there. Run from the repository root:
#
#   bash tools/device/build-tests.sh
#
# It needs the CUDA toolchain (sourced from ../shared/tools/cuda-env.sh, or $CUDA_ENV, when nvcc is not
# on PATH). CARGO_TARGET_DIR is honoured.
set -euo pipefail
if ! command -v nvcc > /dev/null; then
    # shellcheck source=/dev/null
    . "${CUDA_ENV:-../shared/tools/cuda-env.sh}"
fi
exe=$(cargo test --release --no-run --features cuda -p prism-device-tests --message-format=json \
    | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "device" and m.get("executable"):
        print(m["executable"])
')
[ -n "$exe" ] || { echo "build-tests: no test executable in cargo's output" >&2; exit 1; }
mkdir -p .device-carry
strip -o /tmp/device-tests "$exe"
xz -T2 -6 -c /tmp/device-tests > .device-carry/device-tests.xz
echo "build-tests: $exe"
echo "build-tests: $(stat -c %s "$exe") bytes, stripped $(stat -c %s /tmp/device-tests), .device-carry/device-tests.xz $(stat -c %s .device-carry/device-tests.xz)"
