#!/usr/bin/env bash
# CPU demo of DMuon inside TorchTitan: the llama3 debug model on 2 CPU ranks.
#
#   bash scripts/demo.sh              # set up if needed, then train with DMuon (~200 steps)
#   bash scripts/demo.sh --compare    # also train the AdamW baseline on identical data and
#                                     # write outputs/demo/loss_dmuon_vs_adamw.png + summary.txt
#   bash scripts/demo.sh --ns-algorithms
#                                     # DMuon twice, Newton-Schulz in float32: "standard" and
#                                     # "auto" (Gram where it is cheaper); writes
#                                     # outputs/demo/loss_ns_algorithms.png + summary.txt
#   bash scripts/demo.sh --momentum-dtypes
#                                     # DMuon three times, momentum kept in the parameters'
#                                     # fp32, in bf16 and in int8 (then fp32 again at seeds 1
#                                     # and 2: the seed noise); writes
#                                     # outputs/demo/loss_momentum_dtypes.png + summary.txt
#
# Options:
#   --steps N      train N steps instead of the TOML's 200 (both runs in --compare)
#   --setup        run scripts/setup.sh even if the packages already import
#   -h, --help     this text
#
# Everything written goes under outputs/ (git-ignored: the script drops a
# .gitignore there). Needs no GPU and no network once the packages are installed.
set -euo pipefail

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; }

compare=0
ns_algorithms=0
momentum_dtypes=0
force_setup=0
steps=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --compare) compare=1 ;;
        --ns-algorithms) ns_algorithms=1 ;;
        --momentum-dtypes) momentum_dtypes=1 ;;
        --setup) force_setup=1 ;;
        --steps) steps="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

cd "$(dirname "$0")/.."   # repository root: the TOMLs use paths relative to it
# 1. Packages: torch, torchtitan, dmuon and this repo's extension, in .venv (scripts/setup.sh).
PYTHON=.venv/bin/python
if [[ $force_setup == 1 ]] || ! "$PYTHON" -c "import torch, torchtitan, dmuon, torchtitan_ext" >/dev/null 2>&1; then
    echo "== installing (scripts/setup.sh)"
    PYTHON=$(bash scripts/setup.sh)
fi

# 2. Output folder, never committed.
mkdir -p outputs/demo
[[ -f outputs/.gitignore ]] || echo '*' > outputs/.gitignore

# Two ranks on a 2-core machine: one intra-op thread each avoids oversubscription.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Pass every line through except training step lines other than step 1 and every 10th.
show_every_10th_step() {
    awk '{
        if ($0 !~ /validate/ && match($0, / step: *[0-9]+ +loss/)) {
            step = substr($0, RSTART, RLENGTH); gsub(/[^0-9]/, "", step)
            if (step != 1 && step % 10 != 0) next
        }
        print; fflush()
    }'
}

# train NAME TOML [extra TorchTitan args...]: rank 0's output to outputs/demo/NAME.log and
# to the console (minus the step lines between every 10th step).
train() {
    local name="$1" toml="$2"
    shift 2
    local extra=("$@")
    [[ -n "$steps" ]] && extra+=(--training.steps "$steps")
    echo "== training with $name ($toml)"
    local status=0
    rm -rf "outputs/demo/${name}_ranks"
    # Console: rank 0 only. Every rank's full output also goes to outputs/demo/NAME_ranks/.
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 --local-ranks-filter 0 \
        --log-dir "outputs/demo/${name}_ranks" --redirects 3 --tee 3 \
        -m torchtitan.train --job.config_file "$toml" "${extra[@]}" 2>&1 \
        | tee "outputs/demo/$name.log" | show_every_10th_step || status=$?
    if [[ $status != 0 ]]; then
        echo "$name run failed (exit $status); see outputs/demo/$name.log and outputs/demo/${name}_ranks/" >&2
        exit 1
    fi
}

# summary LOG_NAME... [-- PLOT]: a closing summary from the runs' own logs (steps, first and
# last train and validation loss, where the logs, checkpoints and plot are; scripts/demo_summary.py).
summary() {
    local args=() plot=""
    while [[ $# -gt 0 ]]; do
        if [[ $1 == -- ]]; then plot="$2"; break; fi
        args+=(--run "$1=outputs/demo/$1.log"); shift
    done
    [[ -n "$steps" ]] && args+=(--steps "$steps")
    [[ -n "$plot" ]] && args+=(--plot "$plot")
    "$PYTHON" scripts/demo_summary.py --toml train_configs/llama3_debug_dmuon.toml "${args[@]}"
}

if [[ $ns_algorithms == 1 ]]; then
    # float32 on both sides: "auto" runs Gram in the dtype it is given, and on a CPU
    # "auto" with bf16 stays "standard" (docs/optimizer.md#ns_algorithm).
    for algorithm in standard auto; do
        train "ns_$algorithm" train_configs/llama3_debug_dmuon.toml --metrics.log_freq 1 \
            --optimizer.ns_dtype float32 --optimizer.ns_algorithm "$algorithm"
    done
    echo "== comparison"
    "$PYTHON" scripts/compare.py --run standard=outputs/demo/ns_standard.log --run auto=outputs/demo/ns_auto.log \
        --name loss_ns_algorithms --out outputs/demo
    summary ns_standard ns_auto -- outputs/demo/loss_ns_algorithms.png
    exit 0
fi

if [[ $momentum_dtypes == 1 ]]; then
    # Same data, seed and schedule; only where the momentum is kept between steps differs.
    for dtype in param bfloat16 int8; do
        train "momentum_$dtype" train_configs/llama3_debug_dmuon.toml --metrics.log_freq 1 \
            --optimizer.momentum_dtype "$dtype"
    done
    for seed in 1 2; do  # the seed noise: fp32 momentum from other initial weights
        train "momentum_param_seed$seed" train_configs/llama3_debug_dmuon.toml --metrics.log_freq 1 \
            --debug.seed "$seed"
    done
    echo "== comparison"
    "$PYTHON" scripts/compare.py --run fp32=outputs/demo/momentum_param.log \
        --run bf16=outputs/demo/momentum_bfloat16.log --run int8=outputs/demo/momentum_int8.log \
        --run "fp32 seed 1"=outputs/demo/momentum_param_seed1.log \
        --run "fp32 seed 2"=outputs/demo/momentum_param_seed2.log --relative-to fp32 \
        --name loss_momentum_dtypes --out outputs/demo
    summary momentum_param momentum_bfloat16 momentum_int8 momentum_param_seed1 momentum_param_seed2 \
        -- outputs/demo/loss_momentum_dtypes.png
    exit 0
fi

if [[ $compare == 0 ]]; then
    train dmuon train_configs/llama3_debug_dmuon.toml
    summary dmuon
    exit 0
fi

# --compare: per-step loss lines for smooth curves; same data, seed and schedule for both.
train dmuon train_configs/llama3_debug_dmuon.toml --metrics.log_freq 1
train adamw train_configs/llama3_debug_adamw.toml --metrics.log_freq 1
echo "== comparison"
"$PYTHON" scripts/compare.py --dmuon outputs/demo/dmuon.log --adamw outputs/demo/adamw.log --out outputs/demo
summary dmuon adamw -- outputs/demo/loss_dmuon_vs_adamw.png
