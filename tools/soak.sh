#!/usr/bin/env bash
# Soak test of `prism serve` on this machine (loopback only, bounded): 64 clients for 10 minutes on the
# bundled demo model, 10 % hostile bodies, 5 % clients that leave mid-request. Not part of CI; its runs
# are recorded in docs/correctness.md. Arguments go to tools/soak.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
PRISM=${PRISM:-target/debug/prism}
if [ "$PRISM" = target/debug/prism ]; then cargo build -q -p prism-cli; fi
exec python3 tools/soak.py --prism "$PRISM" "$@"
