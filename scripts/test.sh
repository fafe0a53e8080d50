#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh: a .venv with torch 2.13.0) and runs the test suite's
# default tier: every test but those marked `extended` (the second tier, which CI runs too:
# `bash scripts/test.sh -m extended`). Extra arguments go to pytest and win over these
# defaults, e.g. `bash scripts/test.sh -k plan` or `bash scripts/test.sh -n 0` (one process).
#
# Two pytest-xdist workers: one takes the multi-rank tests (on shared ranks,
# tests/multiprocess.py), the other TorchTitan's torchrun jobs, each one launch at a time,
# and the in-process tests fill both (tests/conftest.py groups them).
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then  # answered before the setup installs anything
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        echo
        echo "usage: bash scripts/test.sh [pytest arguments]   (pytest's own help: .venv/bin/python -m pytest --help)"
        exit 0
    fi
done
python=$(bash scripts/setup.sh)
export OMP_NUM_THREADS=1
exec "$python" -m pytest -n 2 --dist loadgroup -m "not extended" "$@"
