#!/usr/bin/env bash
# CPU demo of DMuon inside TorchTitan 0.3: the llama3 debug model on 2 CPU ranks (gloo, FSDP2).
#
#   bash scripts/demo_titan03.sh               # train with DMuon (200 steps, a few minutes)
#   bash scripts/demo_titan03.sh --adamw       # the same run with AdamW (the baseline)
#   bash scripts/demo_titan03.sh --steps 50    # fewer steps
#
# The job is TorchTitan 0.3's own launcher with this repo's config functions:
#
#   OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m torchtitan.train \
#       --module torchtitan_ext.titan03.configs --config llama3_debug_cpu
#
# Any further argument is passed to TorchTitan (e.g. --training.seq_len 128).
# Setup is part of the command: without PYTHON it makes (or checks) the environment
# .venv-titan0.3 (TorchTitan 0.3.0 over torch 2.15.0, the registry's CUDA build, ~6 GB
# installed, runs on CPU) with scripts/setup_titan03.sh. PYTHON picks another interpreter that has
# TorchTitan 0.3.x. Output goes under outputs/ (git-ignored). Needs no GPU.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

config=llama3_debug_cpu
extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --adamw) config=llama3_debug_cpu_adamw ;;
        --steps) extra+=(--training.steps "$2"); shift ;;
        -h|--help) usage; exit 0 ;;
        *) extra+=("$1") ;;
    esac
    shift
done

cd "$(dirname "$0")/.."   # repository root: the config's paths are relative to it
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=$(bash scripts/setup_titan03.sh)
fi
if ! "$PYTHON" -c "import torchtitan, sys; sys.exit(not torchtitan.__version__.startswith('0.3'))" 2>/dev/null; then
    echo "$PYTHON has no TorchTitan 0.3.x; set PYTHON or run: bash scripts/setup_titan03.sh" >&2
    exit 1
fi
mkdir -p outputs/demo_titan03
[[ -f outputs/.gitignore ]] || echo '*' > outputs/.gitignore

# Two ranks on a small machine: one intra-op thread each avoids oversubscription.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's torchtitan_ext

echo "== training $config (rank 0's output also in outputs/demo_titan03/$config.log)"
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 --local-ranks-filter 0 \
    -m torchtitan.train --module torchtitan_ext.titan03.configs --config "$config" \
    ${extra[@]+"${extra[@]}"} 2>&1 | tee "outputs/demo_titan03/$config.log"
