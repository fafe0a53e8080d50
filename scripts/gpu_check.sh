#!/usr/bin/env bash
# Everything this project checks on a GPU, in one command, for the day a CUDA machine is
# at hand (no session of this project has had one so far):
#
#   bash scripts/gpu_check.sh            # every GPU the machine has (torchrun over them)
#
# 1. the CUDA tests (tests/test_cuda.py: exactness and robustness on NCCL);
# 2. real DMuon steps under torch.cuda.set_sync_debug_mode("error") (benchmarks.sync_free_step);
# 3. Newton-Schulz TFLOP/s against the GPU's own bf16 matmul rate (benchmarks.ns_throughput);
# 4. the benchmark with --device cuda (benchmarks.bench);
# 5. a one-GPU TorchTitan run of the debug model with DMuon (train_configs/llama3_debug_dmuon.toml).
#
# Logs go to outputs/gpu_check/; a summary table ends the run. Exits 1 if any check failed,
# and at once, with a message, if no CUDA GPU is visible: it never skips silently.
#   PYTHON   the interpreter (default: .venv-torch2.15, made by scripts/setup.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [[ -z "$python" ]]; then
    python=$(DMUON_VENV=.venv-torch2.15 TORCH_VERSION=2.15.0 bash scripts/setup.sh) || exit 1
fi
if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU is visible to torch ($("$python" -c 'import torch; print(torch.__version__)')," \
         "torch.cuda.is_available() is False): run it on a machine with an NVIDIA GPU and its driver" >&2
    exit 1
fi
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
device=$("$python" -c "import torch; print(torch.cuda.get_device_name(0))")
logs=outputs/gpu_check
mkdir -p "$logs"
summary=()
check() {  # check NAME CMD...: run, log, and add a row (the log's last line is the figure)
    local name=$1; shift
    echo "== $name: $*"
    if "$@" > "$logs/$name.log" 2>&1; then status=ok; else status=FAILED; failed=1; fi
    summary+=("$(printf '%-16s %-7s %s' "$name" "$status" "$(tail -n 1 "$logs/$name.log" | cut -c1-110)")")
}
failed=0
torchrun=("$python" -m torch.distributed.run --standalone --nproc-per-node "$gpus")
check cuda_tests "$python" -m pytest tests/test_cuda.py -q
check sync_free "${torchrun[@]}" -m benchmarks.sync_free_step
check ns_throughput "$python" -m benchmarks.ns_throughput --device cuda
check bench "${torchrun[@]}" -m benchmarks.bench --device cuda --dim 4096 --layers 8
check torchtitan "$python" -m torch.distributed.run --standalone --nproc-per-node 1 -m torchtitan.train \
    --job.config_file train_configs/llama3_debug_dmuon.toml --training.steps 20
echo
echo "GPU check on $gpus x $device (logs: $logs/)"
printf '%s\n' "${summary[@]}"
exit $failed
