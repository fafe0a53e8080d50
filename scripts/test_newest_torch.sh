#!/usr/bin/env bash
# The stated subset of the suite on the newest torch the registry serves (2.15.0), in an
# environment of its own (.venv-torch2.15; the CUDA build, ~3.7 GB, runs on CPU): every
# in-process and multi-rank test (core exactness, every layout, TorchTitan's own
# parallelize), then one TorchTitan 0.2.x end-to-end run (train, checkpoint, resume).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(DMUON_VENV=.venv-torch2.15 TORCH_VERSION=2.15.0 bash scripts/setup.sh)
export OMP_NUM_THREADS=1
"$python" -c "import torch; print('torch', torch.__version__)"
"$python" -m pytest -m "unit or multirank" "$@"
exec "$python" -m pytest tests/test_torchtitan_e2e.py -k "resuming_from_a_checkpoint or loss_at_the_last_step" "$@"
