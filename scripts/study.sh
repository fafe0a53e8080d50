#!/usr/bin/env bash
# Convergence study on the CPU demo (llama3 debug model, embedded pydoc corpus, 2 CPU ranks):
# AdamW against DMuon variants, same data order, seed, schedule and step count.
#
#   bash scripts/study.sh [--steps N] [RUN ...]     # default: every run below, in this order
#
# Runs (each a variant of train_configs/llama3_debug_*.toml, written to outputs/study/NAME.toml):
#   adamw            AdamW lr 2e-3, wd 0.1 (the demo baseline)
#   original         DMuon adjust_lr "original", lr 0.02, AdamW part 2e-3 (the demo config)
#   original_pe      the same with ns_coefficients = "polar_express"
#   match_rms        DMuon adjust_lr "match_rms_adamw" reusing AdamW's lr 2e-3 and wd 0.1 (Moonlight)
#   match_rms_pe     the same with ns_coefficients = "polar_express"
#   normuon          the demo config with normuon = true
#   qk_clip          the demo config with qk_clip_threshold = 8.0 (about half the largest
#                    attention logit the demo reaches without it, ~17 near step 140)
#   momentum_bf16    the demo config with momentum_dtype = "bfloat16"
#   momentum_int8    the demo config with momentum_dtype = "int8"
#   adamw_state_param, adamw_state_bf16, adamw_state_int8
#                    momentum_dtype = "int8" with adamw_state_dtype = "param", "bfloat16", "int8"
#
#   bash scripts/study.sh --seed N [RUN ...]  # the runs with --debug.seed N, logged as NAME_seedN
#
#   bash scripts/study.sh --check [RUN ...]  # only write the runs' TOMLs and parse them
#
# Rank 0's console goes to outputs/study/NAME.log; then
#   python scripts/compare.py --adamw outputs/study/adamw.log --dmuon outputs/study/original.log ...
# turns the logs into plots and tables (see docs/study.md).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"   # scripts/setup.sh makes it
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
out=outputs/study
mkdir -p "$out"
[[ -f outputs/.gitignore ]] || echo '*' > outputs/.gitignore

steps=()
seed=""
runs=()
check=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --steps) steps=(--training.steps "$2"); shift ;;
        --check) check=1 ;;
        --seed) seed=$2; shift ;;
        -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) runs+=("$1") ;;
    esac
    shift
done
[[ ${#runs[@]} -gt 0 ]] || runs=(adamw original original_pe match_rms match_rms_pe normuon qk_clip momentum_bf16
                                 momentum_int8)

dmuon=train_configs/llama3_debug_dmuon.toml
# variant NAME BASE_TOML SED_EXPR...: BASE_TOML with each `key = value` line rewritten.
variant() {
    local name="$1" base="$2"
    shift 2
    local args=()
    for expr in "$@"; do args+=(-e "$expr"); done
    sed "${args[@]}" -e "s|^dump_folder = .*|dump_folder = \"./$out/$name\"|" "$base" > "$out/$name.toml"
}
variant adamw train_configs/llama3_debug_adamw.toml
variant original "$dmuon"
variant original_pe "$dmuon" 's|^ns_coefficients = .*|ns_coefficients = "polar_express"|'
variant match_rms "$dmuon" 's|^lr = .*|lr = 2e-3|' 's|^adjust_lr = .*|adjust_lr = "match_rms_adamw"|'
variant match_rms_pe "$dmuon" 's|^lr = .*|lr = 2e-3|' 's|^adjust_lr = .*|adjust_lr = "match_rms_adamw"|' \
    's|^ns_coefficients = .*|ns_coefficients = "polar_express"|'
variant normuon "$dmuon" 's|^normuon = [a-z]*|normuon = true|'
variant qk_clip "$dmuon" 's|^qk_clip_threshold = [0-9.]*|qk_clip_threshold = 8.0|'
variant momentum_bf16 "$dmuon" 's|^momentum_dtype = .*|momentum_dtype = "bfloat16"|'
variant momentum_int8 "$dmuon" 's|^momentum_dtype = .*|momentum_dtype = "int8"|'
for form in param:param bf16:bfloat16 int8:int8; do
    variant "adamw_state_${form%%:*}" "$dmuon" 's|^momentum_dtype = .*|momentum_dtype = "int8"|' \
        "s|^adamw_state_dtype = .*|adamw_state_dtype = \"${form#*:}\"|"
done

if [[ $check == 1 ]]; then  # TorchTitan's own parser, with dmuon's [optimizer] checks
    for name in "${runs[@]}"; do
        [[ -f "$out/$name.toml" ]] || { echo "unknown run: $name" >&2; exit 2; }
        "$PYTHON" -c "import sys; from torchtitan.config import ConfigManager; \
o = ConfigManager().parse_args(['--job.config_file', sys.argv[1]]).optimizer; \
print(sys.argv[1], 'parses:', o.name, 'lr', o.lr, 'qk_clip_threshold', o.qk_clip_threshold, \
'normuon', o.normuon)" "$out/$name.toml"
    done
    exit 0
fi

for run in "${runs[@]}"; do
    [[ -f "$out/$run.toml" ]] || { echo "unknown run: $run" >&2; exit 2; }
    name=$run${seed:+_seed$seed}
    [[ -z "${seed:-}" ]] || cp "$out/$run.toml" "$out/$name.toml"
    sed -i "s|^dump_folder = .*|dump_folder = \"./$out/$name\"|" "$out/$name.toml"
    echo "== $name ($(date -u +%H:%M:%S) UTC)"
    grep -E '^(name|lr|adamw_lr|weight_decay|adjust_lr|ns_coefficients|normuon|qk_clip_threshold|momentum_dtype|adamw_state_dtype) =' \
        "$out/$name.toml" | sed 's/ *#.*//'
    rm -rf "$out/${name}_ranks"
    # Every DMuon run records its largest attention logit per step (measured only: no
    # clipping without a threshold), so runs can be compared with and without QK-clip.
    logits=()
    grep -q '^name = "DMuon"' "$out/$name.toml" && logits=(--optimizer.track_max_logits)
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2 --local-ranks-filter 0 \
        --log-dir "$out/${name}_ranks" --redirects 3 --tee 3 \
        -m torchtitan.train --job.config_file "$out/$name.toml" --metrics.log_freq 1 "${logits[@]}" "${steps[@]}" \
        ${seed:+--debug.seed "$seed"} \
        > "$out/$name.log" 2>&1 || { echo "$name failed; see $out/$name.log" >&2; exit 1; }
    grep -E "step: *[0-9]+ " "$out/$name.log" | tail -2
done
echo "== done ($(date -u +%H:%M:%S) UTC)"
