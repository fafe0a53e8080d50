#!/usr/bin/env bash
# Installs everything dmuon, its tests and the TorchTitan demo need into a virtual
# environment of the project's own (never into the system's Python), and prints that
# environment's python. Idempotent: a second run only checks.
#
#   DMUON_VENV      the environment (default .venv, relative to the repository root)
#   TORCH_VERSION   the torch it holds (default 2.13.0: the small CPU build; 2.11.0 and
#                   2.15.0 are the registry's CUDA builds, ~3-4 GB, and run on CPU too)
#   TRITON_VERSION  the triton installed when torch brings none (the CPU build; default 3.9.0)
#   DMUON_EXTRAS    dmuon's extras to install (default "torchtitan,test": TorchTitan 0.2.2;
#                   "titan03,test" gives TorchTitan 0.3.0, which wants torch 2.14 or newer)
#   DMUON_BASE_VENV an environment whose packages this one sees beneath its own (one line
#                   in a .pth file): two environments then share one torch install instead
#                   of holding two (torch 2.15 with its CUDA packages is ~6 GB on disk)
#   PYTHON          the Python 3.11 that creates the environment (default python3)
#
# torch goes first and pinned, so that torchtitan's own requirement on torch is
# already met by it. pip keeps no cache of it: a clean CI machine has no use for a second
# copy of a multi-GB wheel, and disk there is tight.
set -euo pipefail
cd "$(dirname "$0")/.."
# Some machines cap packages for pip in a machine-wide constraints file (e.g. torch<=2.14.1,
# to prefer the releases on their own disk); that cap would refuse the torch asked for here.
# An explicit constraints file replaces the machine's for every pip call of this script.
export PIP_CONSTRAINT="$PWD/scripts/pip_constraints.txt"
venv=${DMUON_VENV:-.venv}
torch_version=${TORCH_VERSION:-2.13.0}
if [[ ! -x "$venv/bin/python" ]]; then
    # A Python without its venv module (Debian's python3 without python3-venv) gets one from pip.
    "${PYTHON:-python3}" -m venv "$venv" >&2 2>/dev/null || {
        rm -rf "$venv"
        "${PYTHON:-python3}" -m pip install --quiet --user virtualenv >&2
        "${PYTHON:-python3}" -m virtualenv --quiet "$venv" >&2
    }
fi
python="$venv/bin/python"
if [[ -n "${DMUON_BASE_VENV:-}" ]]; then
    # A .pth line appends the base's site-packages to sys.path after this environment's own, so
    # what is installed here (e.g. another TorchTitan release) shadows the base's copy, and pip
    # leaves the base untouched (it never uninstalls outside the running environment).
    purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
    base_site=$("$DMUON_BASE_VENV/bin/python" -c "$purelib")
    echo "$base_site" > "$("$python" -c "$purelib")/dmuon_base_venv.pth"
fi
if ! "$python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    "$python" -m pip install --quiet --no-cache-dir "torch==$torch_version" >&2
fi
# `import torchtitan` needs triton. A CUDA build of torch brings its own (kept: the extra's
# bound is met); the CPU build brings none, and this pin keeps CI on the one it was tested with.
if ! "$python" -c "import triton" 2>/dev/null; then
    "$python" -m pip install --quiet --no-cache-dir "triton==${TRITON_VERSION:-3.9.0}" >&2
fi
"$python" -m pip install --quiet -e ".[${DMUON_EXTRAS:-torchtitan,test}]" >&2
echo "$python"
