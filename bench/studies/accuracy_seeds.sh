#!/usr/bin/env bash
# The accuracy study over seeds in parallel, one process and one CPU thread per (kind, seed), all
# on the one device, then one merged record file + report in OUT_DIR (the per-run files and logs
# are packed into OUT_DIR/accuracyTAG_runs.tgz).
#   [TIME_LIMIT=SECONDS] bench/studies/accuracy_seeds.sh OUT_DIR TAG "KIND..." "SEED..." [accuracy_reference.py options...]
# e.g. bench/studies/accuracy_seeds.sh "$OUT" _h200 "lazytrain torch_bf16_master torch_autocast_bf16" "1 2 3 4 5"
# TIME_LIMIT stops a run still going after that many seconds; the runs that finished are merged.
# PYTHON picks the interpreter (default: python).
set -euo pipefail
out=$1 tag=$2 kinds=$3 seeds=$4
shift 4
cd "$(dirname "$0")/../.."
python=${PYTHON:-python}
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
runs="$out/accuracy$tag"
mkdir -p "$runs"
limit=()
if [[ -n ${TIME_LIMIT:-} ]]; then limit=(timeout -k 5 "$TIME_LIMIT"); fi
for kind in $kinds; do
  for seed in $seeds; do
    ${limit[@]+"${limit[@]}"} "$python" -m bench.studies.accuracy_reference --kinds "$kind" --seeds "$seed" \
      --tag "_${kind}_s$seed" --out "$runs" "$@" > "$runs/${kind}_s$seed.log" 2>&1 &
  done
done
wait
for f in "$runs"/*.log; do tail -n 3 "$f"; done
shopt -s nullglob
records=("$runs"/*.json)
if (( ${#records[@]} )); then
  "$python" -m bench.studies.accuracy_reference --merge "${records[@]}" --tag "$tag" --out "$out"
else
  echo "accuracy$tag: no run finished"
fi
tar czf "$out/accuracy${tag}_runs.tgz" -C "$out" "accuracy$tag"
rm -rf "$runs"
