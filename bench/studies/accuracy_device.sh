#!/usr/bin/env bash
# Issue 20's GPU measurements in one call that returns within END seconds (default 525), all
# under OUT_DIR:
#   bench/studies/accuracy_device.sh OUT_DIR
# 1. bench/studies/embed_grad_cost.py: the fp32 embedding-gradient sum against bf16 autograd at the
#    Qwen2.5-7B shape (b64 x s1024), the device to itself (seconds).
# 2. At once:
#    - the built-in accuracy study (bench/studies/accuracy_seeds.sh: A_KINDS x A_SEEDS, one process and
#      one thread each, niced so that it takes the cores the pretraining leaves);
#    - the 8-bit fine-tuning study (bench/studies/accuracy_finetune_8bit.py --jobs): the shared
#      pretraining (PRETRAIN_THREADS threads), then JOBS fine-tunes at once, the paired fp32 and
#      8-bit runs seed by seed first, the null last, stopped 20 s before END.
# Each study ends as one record file + report; per-run files and logs are packed in .tgz files.
# The CPU step of the 0.5B fine-tunes (host memory bandwidth) bounds how many finish.
# Settings (environment): END, TAG (file names, default _h200), A_KINDS, A_SEEDS, A_ARGS (more
# accuracy_reference.py options), B_SEEDS, B_ARGS (more accuracy_finetune_8bit.py options), JOBS,
# PRETRAIN_THREADS (default 8 beside the accuracy study, every core without it), EMBED_ARGS
# (embed_grad_cost.py options; EMBED=0 skips it), PYTHON (default python3). A_KINDS="" skips the accuracy study;
# B_ARGS="--pretrained DIR" (DIR outside OUT_DIR) keeps the pretraining for a later call on the
# same, still warm machine, which then only fine-tunes. The CPU test:
#   END=200 TAG=_cpu JOBS=2 PRETRAIN_THREADS=1 EMBED_ARGS="--model tiny --batch 2 --seq 64 --device cpu" \
#   A_KINDS="lazytrain torch_fp32" A_SEEDS="0 1" A_ARGS="--steps 5 --heldout 4 --device cpu" B_SEEDS="1 2" \
#   B_ARGS="--shape tiny --pretrain-steps 5 --finetune-steps 5 --heldout 4 --device cpu" bench/studies/accuracy_device.sh OUT
set -uo pipefail
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/../.."
export PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
end=${END:-525} tag=${TAG:-_h200}
scratch=$(mktemp -d)  # pretrained and fine-tuned models, checkpoints: never under OUT_DIR
trap 'rm -rf "$scratch"' EXIT
left() { echo $((end - SECONDS)); }
note() { echo "[$SECONDS s] $*"; }

if [[ ${EMBED:-1} == 0 ]]; then
  note "embed_grad_cost: skipped (EMBED=0)"
else
  note "embed_grad_cost"
  # shellcheck disable=SC2086
  timeout -k 5 90 "$PYTHON" -m bench.studies.embed_grad_cost ${EMBED_ARGS:-} --out "$out" > "$out/embed_grad_cost.log" 2>&1 \
    || note "embed_grad_cost: exit $?"
fi

a_kinds=${A_KINDS-lazytrain torch_fp32 torch_autocast_bf16 torch_bf16_master}  # set but empty: no study
accuracy=
if [[ -n $a_kinds ]]; then
  note "accuracy study, built-in default (background)"
  read -ra seeds <<< "${A_SEEDS:-0 1 2 3 4}"
  # shellcheck disable=SC2086
  TIME_LIMIT=$(($(left) - 30)) nice -n 10 bash bench/studies/accuracy_seeds.sh "$out" "${tag}_s${seeds[0]}-${seeds[-1]}" \
    "$a_kinds" "${seeds[*]}" ${A_ARGS:-} > "$out/accuracy_seeds.log" 2>&1 &
  accuracy=$!
else
  note "accuracy study: skipped (A_KINDS is empty)"
fi

note "8-bit fine-tuning study"
limit=$(($(left) - 20))
# shellcheck disable=SC2086
timeout -k 5 $((limit + 10)) "$PYTHON" -m bench.studies.accuracy_finetune_8bit --shape qwen2.5-0.5b --seeds ${B_SEEDS:-1 2 3 4 5} \
  --jobs "${JOBS:-3}" --time-limit "$limit" --pretrain-threads "${PRETRAIN_THREADS:-$([[ -n $accuracy ]] && echo 8 || nproc)}" --scratch "$scratch" \
  --out "$out" --tag "$tag" ${B_ARGS:-} > "$out/finetune_8bit.log" 2>&1 || note "finetune_8bit: exit $?"
for runs in "$out"/finetune_8bit_*_runs; do  # left by a study stopped from outside: merge what it finished
  [[ -d $runs ]] || continue
  shopt -s nullglob
  records=("$runs"/*.json)
  if ((${#records[@]})); then
    "$PYTHON" -m bench.studies.accuracy_finetune_8bit --merge "${records[@]}" --tag "$tag" --out "$out" >> "$out/finetune_8bit.log" 2>&1
  fi
  tar czf "$runs.tgz" -C "$out" "$(basename "$runs")" && rm -rf "$runs"
done

if [[ -n $accuracy ]]; then wait "$accuracy" || note "accuracy_seeds: exit $?"; fi
note "done"
grep -hE ": (started|finished|failed|stopped|not started)" "$out/finetune_8bit.log"
logs=()
for log in embed_grad_cost accuracy_seeds finetune_8bit; do [[ -f $out/$log.log ]] && logs+=("$log.log"); done
tar czf "$out/accuracy_device_logs.tgz" -C "$out" "${logs[@]}" && (cd "$out" && rm -f "${logs[@]}")
ls -l "$out"
for report in "$out"/*.md; do echo; cat "$report"; done
