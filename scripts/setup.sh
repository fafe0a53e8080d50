#!/usr/bin/env bash
# Installs everything dmuon, its tests and the TorchTitan demo need, into the current
# Python (3.11). Idempotent: a second run only checks. torch goes first and pinned, so
# that torchtitan's own requirement on torch is already met by the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.') else 1)" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[torchtitan,test]"
