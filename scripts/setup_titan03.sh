#!/usr/bin/env bash
# The TorchTitan 0.3.x environment, and prints its python. TorchTitan 0.3.0 wants torch 2.14
# or newer, so it runs on torch 2.15.0 (the registry's CUDA build; ~6 GB installed, runs on
# CPU). Rather than a second copy of that torch, .venv-titan0.3 holds only TorchTitan 0.3.0
# and its own requirements, over the packages of .venv-torch2.15 (torch 2.15 + TorchTitan
# 0.2.2), which it makes first if needed. Idempotent, like scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
DMUON_VENV=.venv-torch2.15 TORCH_VERSION=2.15.0 bash scripts/setup.sh >/dev/null
DMUON_VENV=.venv-titan0.3 DMUON_BASE_VENV=.venv-torch2.15 TORCH_VERSION=2.15.0 \
    DMUON_EXTRAS=titan03,test bash scripts/setup.sh
