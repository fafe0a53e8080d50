#!/usr/bin/env bash
# Downloads, here (with network), the wheels scripts/gpu_check.sh installs on the GPU machine
# (no network there): scripts/gpu_wheels.txt, for CPython 3.12 on manylinux x86_64, into the
# git-ignored .whl/ that travels with the checkout. No dependencies are followed: the list is
# complete against the machine's image. Idempotent; fails if the folder grows past its budget
# (the checkout and the carried files together must stay under 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_KIB=${GPU_WHEELS_MAX_KIB:-16384}
export PIP_CONSTRAINT="$PWD/scripts/pip_constraints.txt"  # no machine-wide cap applies here
mkdir -p .whl
python=${PYTHON:-python3}
mapfile -t wheels < <(grep -v '^\s*#' scripts/gpu_wheels.txt | grep -v '^\s*$')
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl "${wheels[@]}"
kib=$(du -sk .whl | cut -f1)
echo "gpu_wheels: $(ls .whl/*.whl | wc -l) wheels in .whl/ ($kib KiB)"
if (( kib > MAX_KIB )); then
    echo "gpu_wheels: .whl/ holds $kib KiB, more than its $MAX_KIB KiB budget" >&2
    exit 1
fi
