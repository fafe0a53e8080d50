#!/usr/bin/env bash
# Everything this project checks on a GPU, in one command, on the bare GPU machine as it is
# (one GPU, no network, its own Python 3.12 and torch 2.11.0+cu130; no session has had one yet):
#
#   bash scripts/gpu_wheels.sh                    # here, with network: .whl/ (carried along)
#   bash scripts/gpu_check.sh OUT                 # there: summary.json and <= 6 logs in OUT
#   bash scripts/gpu_check.sh --rehearse OUT      # a CPU-only machine, torch >= 2.11: the same
#                                                 # script end to end, CUDA parts in CPU forms
#
# It never installs torch. It uses $PYTHON (default: python3) and its torch (>= 2.11, with CUDA
# unless rehearsing), and installs what that image lacks (scripts/gpu_wheels.txt: TorchTitan
# 0.2.2 and its requirements) from .whl/ with `pip install --no-index --no-deps --target`.
# Parts, each with its own timeout, under a total budget (GPU_CHECK_BUDGET_S, default 450 s:
# 7.5 minutes with setup), so a hang in one leaves the others' figures (issue 41, item 3):
#   cuda_tests    a, c: tests/test_cuda.py (DMuon bitwise torch.optim.Muon and fused AdamW,
#                 every layout on a one-rank NCCL group, the captured step's replay bitwise
#                 eager; the two-GPU tests skip); rehearsal: the CPU contract tests instead
#   sync_free     b: benchmarks.sync_free_step (real steps under set_sync_debug_mode("error"));
#                 rehearsal: python -m dmuon.tools.dry_run (host syncs counted on fake CUDA)
#   ns_throughput d: benchmarks.ns_throughput, standard and Gram NS vs the GPU's bf16 matmul
#   one_rank      e: benchmarks.gpu_check one_rank, llama3 8B at P = 8, 64 and 70B at P = 64,
#                 1024 (fake process group, real CUDA shards) next to plan_report's prediction
#   compare       f: benchmarks.gpu_check compare: DMuon, torch.optim.Muon + AdamW, fused AdamW
#   captured      issue 42: benchmarks.gpu_check captured: a capturable DMuon replayed from one
#                 CUDA graph under a cosine schedule, a NaN grad skipped: bitwise eager, and
#                 the eager against the replayed step time; rehearsal: skipped
#   torchtitan    g: TorchTitan 0.2.2's debug model with DMuon, 20 steps on one GPU: loss falls
#   two_ranks     h: benchmarks.gpu_check two_ranks: P = 2 on one GPU over gloo, or why not
# Logs in OUT: setup.log, tests.log, throughput.log, one_rank.log, torchtitan.log, two_ranks.log.
# Exits 0 when no part failed (skipped parts say why in summary.json), 1 otherwise, 2 on bad use.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rehearse=0
if [[ ${1:-} == --rehearse ]]; then rehearse=1; shift; fi
if [[ $# -ne 1 ]]; then echo "usage: bash scripts/gpu_check.sh [--rehearse] OUT" >&2; exit 2; fi
out=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "gpu_check: cannot make the output folder $1" >&2; exit 2; }
python=${PYTHON:-$(command -v python3)}
budget=${GPU_CHECK_BUDGET_S:-450}
deadline=$(( $(date +%s) + budget ))
work=$(mktemp -d /tmp/dmuon_gpu_check.XXXXXX)
site=$work/site
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
: > "$work/parts.tsv"
failed=0

summarize() { "$python" -m benchmarks.gpu_check_summary "$work" "$out" > /dev/null 2>> "$out/setup.log"; }
record() {  # record NAME STATUS SECONDS LOG REASON
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >> "$work/parts.tsv"
    [[ $2 == failed ]] && failed=1
    echo "== $1: $2 ($3 s)${5:+: $5}"
    summarize
}
skip() { record "$1" skipped 0 "$2" "$3"; }  # skip NAME LOG REASON
part() {  # part NAME LOG TIMEOUT CMD...: run under min(TIMEOUT, what the budget has left)
    local name=$1 log=$2 limit=$3; shift 3
    local left=$(( deadline - $(date +%s) - 15 ))  # 15 s kept for the last summary
    (( limit > left )) && limit=$left
    if (( limit < 20 )); then skip "$name" "$log" "the total budget (${budget} s) was spent"; return; fi
    echo "===== $name (timeout ${limit} s): $*" >> "$out/$log"
    local start=$(date +%s) rc
    timeout -k 10 "$limit" "$@" >> "$out/$log" 2>&1; rc=$?
    local took=$(( $(date +%s) - start ))
    if (( rc == 0 )); then record "$name" ok "$took" "$log" ""
    elif (( rc == 124 || rc == 137 )); then record "$name" failed "$took" "$log" "timed out after ${limit} s"
    else record "$name" failed "$took" "$log" "exit status $rc (see $log)"; fi
}

# ---- setup: the interpreter, its torch, the device, the wheels
{
    echo "python: $python"
    "$python" - "$rehearse" "$work/setup.json" <<'PY'
import json, platform, sys
import torch
rehearse = sys.argv[1] == "1"
cuda = torch.cuda.is_available()
info = {"mode": "rehearsal (CPU)" if rehearse else "gpu", "python": platform.python_version(),
        "torch": torch.__version__, "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "gpus": torch.cuda.device_count() if cuda else 0}
json.dump(info, open(sys.argv[2], "w"), indent=2)
print(info)
PY
} >> "$out/setup.log" 2>&1 || { echo "gpu_check: $python cannot import torch (see $out/setup.log)" >&2; exit 2; }
if ! "$python" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))"; then
    echo "gpu_check: torch $("$python" -c 'import torch; print(torch.__version__)') is older than 2.11" | tee -a "$out/setup.log" >&2
    exit 2
fi
cuda=$("$python" -c "import torch; print(int(torch.cuda.is_available()))")
if [[ $rehearse == 0 && $cuda == 0 ]]; then
    echo "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False);" \
         "on a CPU-only machine run it with --rehearse" | tee -a "$out/setup.log" >&2
    exit 2
fi
if "$python" -c "import torchtitan" 2>/dev/null; then
    echo "TorchTitan already importable: no wheels installed" >> "$out/setup.log"
elif compgen -G ".whl/*.whl" > /dev/null; then
    "$python" -m pip install --quiet --no-index --no-deps --target "$site" .whl/*.whl >> "$out/setup.log" 2>&1 \
        || echo "gpu_check: installing .whl/ failed (see setup.log)" >&2
else
    echo "no .whl/ folder: run scripts/gpu_wheels.sh first (the TorchTitan part will fail)" | tee -a "$out/setup.log" >&2
fi
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c "import dmuon, torchtitan, torchtitan_ext; print('imports: dmuon, torchtitan, torchtitan_ext')" \
    >> "$out/setup.log" 2>&1 || echo "gpu_check: an import failed (see setup.log)" >&2
summarize

# ---- the parts
gc=("$python" -m benchmarks.gpu_check)
pytest_part() { part "$1" tests.log "$2" "$python" -m pytest -q -rs -p no:cacheprovider --junitxml "$work/$1.xml" "${@:3}"; }
if [[ $rehearse == 1 ]]; then
    pytest_part cuda_tests 120 tests/test_cuda.py tests/test_torch_optim_contract.py
    part sync_free tests.log 90 "$python" -m dmuon.tools.dry_run --model debug --world-size 4 --ranks 0
    part ns_throughput throughput.log 60 sh -c '"$0" -m benchmarks.ns_throughput --device cpu --shapes 256x1024 \
        --repeats 1 --ns-dtype float32 --algorithms standard gram --peak-matmul 512 --json > "$1"' \
        "$python" "$work/ns_throughput.json"
    part one_rank one_rank.log 60 "${gc[@]}" one_rank --device cpu --model debug --world-size 4 --steps 2 \
        --out "$work/one_rank.json"
    part compare throughput.log 60 "${gc[@]}" compare --device cpu --dim 256 --layers 1 --steps 2 \
        --out "$work/compare.json"
    titan_steps=4
    skip captured throughput.log "needs a CUDA GPU (CUDA graphs); rehearsal on CPU"
    skip two_ranks two_ranks.log "needs a CUDA GPU (gloo with CUDA tensors on one GPU); rehearsal on CPU"
else
    pytest_part cuda_tests 150 tests/test_cuda.py
    part sync_free tests.log 60 "$python" -m benchmarks.sync_free_step --dim 1024 --steps 3
    part ns_throughput throughput.log 75 sh -c '"$0" -m benchmarks.ns_throughput --device cuda \
        --algorithms standard gram --json > "$1"' "$python" "$work/ns_throughput.json"
    part one_rank one_rank.log 60 "${gc[@]}" one_rank --model llama3-8b --world-size 8 64 --steps 3 \
        --out "$work/one_rank.json"
    part one_rank_70b one_rank.log 60 "${gc[@]}" one_rank --model llama3-70b --world-size 64 1024 --steps 3 \
        --out "$work/one_rank_70b.json"
    part compare throughput.log 60 "${gc[@]}" compare --dim 4096 --layers 2 --out "$work/compare.json"
    part captured throughput.log 60 "${gc[@]}" captured --dim 4096 --layers 2 --out "$work/captured.json"
    titan_steps=20
fi
part torchtitan torchtitan.log 120 "$python" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m torchtitan.train --job.config_file train_configs/llama3_debug_dmuon.toml \
    --training.steps "$titan_steps" --metrics.log_freq 1 --job.dump_folder "$work/titan"
if [[ $rehearse == 0 ]]; then
    part two_ranks two_ranks.log 90 "${gc[@]}" two_ranks --out "$work/two_ranks.json"
fi
summarize
"$python" -m benchmarks.gpu_check_summary "$work" "$out"
echo "gpu_check: summary in $out/summary.json ($(cd "$out" && ls | wc -l) files; work folder $work)"
exit $failed
