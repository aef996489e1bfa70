#!/usr/bin/env bash
# The GPU machine's JIT caches (Triton's compiled kernels and, with fla's FLA_CACHE_RESULTS
# default, its autotuning results; TileLang's and TVM-FFI's builds) carried between sessions:
# the fla + TileLang path spends ~160-180 s of each fresh machine's first Qwen3.5 step
# compiling. Every machine of one kind has the same card, driver and packages, so a cache
# written by one is valid on the next (a stale entry is only recompiled).
#   bench/jit_cache.sh save OUT_DIR   # at the end of a device call: OUT_DIR/jit_cache.tar.xz
#   bench/jit_cache.sh load [FILE]    # at the start of one (default .jit/jit_cache.tar.xz)
# Between: copy the returned file into .jit/ (git-ignored) and carry .jit with .tl and .whl, if
# the three fit the device tool's 64 MiB carry limit (`du -ch .tl .whl .jit`).
set -euo pipefail
dirs=(.triton/cache .tilelang .cache/tilelang .cache/tvm-ffi)
case ${1:-} in
  save)
    out=${2:?usage: bench/jit_cache.sh save OUT_DIR}
    present=()
    for d in "${dirs[@]}"; do [[ -d $HOME/$d ]] && present+=("$d"); done
    if ((${#present[@]} == 0)); then echo "jit_cache: no cache under $HOME (${dirs[*]})"; exit 0; fi
    du -sh "${present[@]/#/$HOME/}" || true
    tar -C "$HOME" -cf - "${present[@]}" | xz -T0 -6 > "$out/jit_cache.tar.xz"
    ls -la "$out/jit_cache.tar.xz"
    ;;
  load)
    file=${2:-.jit/jit_cache.tar.xz}
    if [[ -f $file ]]; then
      tar -C "$HOME" -xJf "$file" && echo "jit_cache: loaded $file ($(du -h "$file" | cut -f1))"
    else
      echo "jit_cache: no $file, kernels compile on first use"
    fi
    ;;
  *) echo "usage: bench/jit_cache.sh save OUT_DIR | load [FILE]" >&2; exit 2 ;;
esac
