#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh: a .venv with torch 2.13.0) and runs the whole
# test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/setup.sh)
export OMP_NUM_THREADS=1
exec "$python" -m pytest "$@"
