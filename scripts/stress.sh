#!/usr/bin/env bash
# Launch the short 2-rank CPU TorchTitan run N times and count the launches that fail.
#
#   bash scripts/stress.sh N
#
# Launches alternate between the AdamW and the DMuon config (odd: AdamW, even: DMuon),
# each 10 steps at seq_len 128 on 2 gloo ranks -- the run the e2e tests use. A launch
# fails if torchrun exits non-zero, times out (300 s), does not log step 10, or any
# rank printed a fatal error (e.g. "terminate called" / "Fatal Python error") even
# though the exit status was 0.
#
# Prints one line per launch and a summary line; exits 1 if any launch failed.
# The logs of failed launches stay in outputs/stress/ (git-ignored); the logs of
# passing launches are deleted.
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }

if [[ $# -ne 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
    usage >&2
    exit 2
fi
launches=$1

cd "$(dirname "$0")/.."   # repository root: the TOMLs use paths relative to it
PYTHON="${PYTHON:-.venv/bin/python}"   # scripts/setup.sh makes it
# Two ranks on a 2-core machine: one intra-op thread each avoids oversubscription.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Import this checkout's torchtitan_ext and dmuon, whatever else is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

out=outputs/stress
rm -rf "$out"
mkdir -p "$out"
[[ -f outputs/.gitignore ]] || echo '*' > outputs/.gitignore

# Build the tokenizer once up front, so every launch does the same work.
tokenizer=outputs/assets/pydoc_tokenizer
"$PYTHON" -c "from torchtitan_ext.tokenizer import ensure_tokenizer; ensure_tokenizer('$tokenizer')"

failed=0
start=$SECONDS
for ((i = 1; i <= launches; i++)); do
    if ((i % 2)); then name=adamw; else name=dmuon; fi
    run="$out/$(printf '%03d' "$i")-$name"
    mkdir -p "$run"
    t0=$SECONDS
    status=0
    timeout -k 10 300 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 \
        --local-ranks-filter 0 --log-dir "$run/ranks" --redirects 3 --tee 3 \
        -m torchtitan.train --job.config_file "train_configs/llama3_debug_$name.toml" \
        --job.dump_folder "$run" --model.hf_assets_path "$tokenizer" \
        --training.seq_len 128 --training.steps 10 --lr_scheduler.warmup_steps 2 \
        --metrics.log_freq 1 --validation.no-enable >"$run/console.log" 2>&1 || status=$?

    problem=""
    if [[ $status == 124 || $status == 137 ]]; then
        problem="timed out"
    elif [[ $status != 0 ]]; then
        problem="exit status $status"
    elif ! grep -Eq 'step: *10 +loss' "$run/console.log"; then
        problem="step 10 not logged"
    elif grep -rqE 'terminate called|Fatal Python error' "$run/ranks"; then
        problem="a rank printed a fatal error"
    fi
    if [[ -z $problem ]]; then
        printf '[%3d/%d] %-5s ok      %3ds\n' "$i" "$launches" "$name" $((SECONDS - t0))
        rm -rf "$run"
    else
        failed=$((failed + 1))
        printf '[%3d/%d] %-5s FAILED  %3ds  %s; logs: %s\n' "$i" "$launches" "$name" \
            $((SECONDS - t0)) "$problem" "$run"
    fi
done

echo "stress: $launches launches ($(((launches + 1) / 2)) AdamW, $((launches / 2)) DMuon), $failed failed, wall $((SECONDS - start)) s"
[[ $failed == 0 ]]
