#!/usr/bin/env bash
# The torch 2.11 leg (the GPU machine's torch; the registry's CUDA build, ~4 GB, runs on CPU),
# in one environment, .venv-torch2.11 (Python 3.12, as on the GPU machine):
#
# 1. the GPU check's rehearsal (bash scripts/gpu_check.sh --rehearse), while the environment
#    holds only what the GPU machine's image holds (scripts/gpu_image_packages.txt) plus the
#    wheels of scripts/gpu_wheels.sh, so a missing wheel or a broken import shows here;
# 2. then dmuon with its TorchTitan 0.2.2 extra, and the torch 2.15 leg's subset less the
#    dry-run sweeps: the in-process tests whose outcome can depend on the torch release (not
#    `any_torch`; the dry run's rules, each on its first case: not `dry_run_sweep`, which
#    torch 2.15's leg runs, tests/dry_runs.py), the multi-rank tests marked `every_torch`
#    (exactness on every layout, the 2 x 2 meshes, TorchTitan's own layouts, DCP resharding;
#    tests/conftest.py), in one pytest call on two workers, and one TorchTitan 0.2.2 run.
#
#   PYTHON          the Python 3.12 that makes the environment (default: the first Python 3.12
#                   that runs: python3.12, then pyenv's 3.12 installs; else python3)
#   DMUON_DROP_VENV 1: delete the environment at the end (CI: disk is tight)
# Arguments go to every pytest call.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
export PIP_CONSTRAINT="$PWD/scripts/pip_constraints.txt"  # no machine-wide cap on torch
venv=.venv-torch2.11

# A python3.12 on PATH may be a pyenv shim that refuses to run (3.12 installed, another
# version selected): try each candidate rather than trusting `command -v`.
python312() {
    local candidate
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
    command -v python3
}

if [[ ! -x $venv/bin/python ]]; then
    "${PYTHON:-$(python312)}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --no-cache-dir -r scripts/gpu_image_packages.txt
fi
python=$venv/bin/python
"$python" -c "import torch, sys; print('torch', torch.__version__, 'Python', sys.version.split()[0])"

bash scripts/gpu_wheels.sh
if "$python" -I -c "import dmuon" 2>/dev/null; then  # -I: not the checkout in the working directory
    echo "test_torch211: $venv already holds dmuon: the rehearsal runs beside it" >&2
fi
PYTHON=$python bash scripts/gpu_check.sh --rehearse outputs/gpu_rehearsal

"$python" -m pip install --quiet --no-cache-dir -e ".[torchtitan,test]"
"$python" -m pytest -n 2 --dist loadgroup -m "(unit or every_torch) and not any_torch and not extended and not dry_run_sweep" "$@"
"$python" -m pytest tests/test_torchtitan_e2e.py -k loss_at_the_last_step "$@"
if [[ ${DMUON_DROP_VENV:-0} == 1 ]]; then rm -rf "$venv"; fi
