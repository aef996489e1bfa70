# Sourced at the start of a device call (the device tool's `run`, carrying .tl and .whl made by
# bench/hybrid_kernels_carry.sh):
#   source bench/device_setup.sh && python -m bench.plan_bench ... --out $OUT
# Installs fla-core and TileLang under /tmp/tl, puts src/ and the repository on PYTHONPATH, and
# logs to $OUT/mem.log every 5 s: the machine's used and available memory, the GPU's used
# memory, and the summed PSS and RSS of torch.compile's worker processes (their RSS counts the
# pages they share with their parent once per worker; PSS divides them). Prints the exit status
# (and any kernel out-of-memory kill) when the call's shell exits.
export PYTHONUNBUFFERED=1
t0=$(date +%s)
if [ -f .tl/tl.tar.xz ]; then
    mkdir -p /tmp/tl && tar -C /tmp/tl -xJf .tl/tl.tar.xz
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tl .whl/fla_core-*.whl
fi
export PYTHONPATH=$PWD/src:$PWD:/tmp/tl:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2; df -h / | tail -1; nproc
echo "setup $(( $(date +%s) - t0 )) s"
set -o pipefail
compile_workers() {
    local pss=0 rss=0 n=0 a b
    for p in $(pgrep -f compile_worker); do
        read -r a b < <(awk '/^Pss:/{p=$2} /^Rss:/{r=$2} END{print p+0, r+0}' "/proc/$p/smaps_rollup" 2>/dev/null)
        pss=$((pss + ${a:-0})); rss=$((rss + ${b:-0})); n=$((n + 1))
    done
    echo "compile workers $n pss_MiB $((pss / 1024)) rss_MiB $((rss / 1024))"
}
(while true; do
    echo "$(date +%T) used/avail MiB $(free -m | awk '/Mem/{print $3, $7}') gpu $(nvidia-smi --query-gpu=memory.used --format=csv,noheader) $(compile_workers)"
    sleep 5
done) > "$OUT/mem.log" 2>&1 &
trap 'rc=$?; echo "exit rc $rc"; dmesg 2>/dev/null | grep -i -E "killed|oom" | tail -3; tail -3 "$OUT/mem.log"' EXIT
