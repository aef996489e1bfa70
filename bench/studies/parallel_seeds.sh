#!/usr/bin/env bash
# Convergence seeds in parallel on a many-core host: one process and one thread per (kind, seed),
# each writing its own record, packed into one archive (the device tool brings back few files).
#   [STEPS=1000] bench/studies/parallel_seeds.sh OUT_DIR TAG "KIND..." "SEED..." [KEY=VALUE...]
# e.g. bench/studies/parallel_seeds.sh "$OUT" _h200-host "fp32 fp32_unfused" "11 12 13" training.device=cpu
# Merge the records afterwards: python -m bench.studies.optim_convergence_seeds --merge OUT_DIR/TAG/*.json
set -euo pipefail
out=$1 tag=$2 kinds=$3 seeds=$4
shift 4
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
if [[ " $kinds " == *" hybrid8bit"* ]]; then  # compile the kernel once, before the runs race for it
  python -c "from lazytrain.optim.kernel import load_kernel; load_kernel(required=True)"
fi
mkdir -p "$out/$tag"
for kind in $kinds; do
  for seed in $seeds; do
    python -m bench.studies.optim_convergence_seeds --steps "${STEPS:-1000}" --seeds "$seed" --kinds "$kind" --tag "${tag}_${kind}_s$seed" \
      --out "$out/$tag" ${*:+--set "$@"} > "$out/$tag/${kind}_s$seed.log" 2>&1 &
  done
done
wait
tar czf "$out/$tag.tgz" -C "$out" "$tag"
rm -rf "${out:?}/$tag"
