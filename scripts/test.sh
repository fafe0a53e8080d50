#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m pytest "$@"
