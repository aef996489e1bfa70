#!/usr/bin/env bash
# fla-core and TileLang for the GPU machine (Python 3.12, x86-64, Hopper, Triton 3.6, no network),
# packed to fit the device tool's 64 MiB carry limit: fla-core 0.6.0 refuses one backward kernel
# on Hopper with Triton < 3.7.1 unless TileLang is installed. The wheels are 82 MB zipped; as one
# .tar.xz of their contents they are about 50 MiB. Writes .tl/tl.tar.xz and .whl/fla_core-*.whl
# (both git-ignored; carry .tl and .whl).
#   bench/hybrid_kernels_carry.sh
# On the machine (then run with --kernels auto):
#   mkdir -p /tmp/tl && tar -C /tmp/tl -xJf .tl/tl.tar.xz
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tl .whl/fla_core-*.whl
#   export PYTHONPATH=/tmp/tl:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .tl .whl; do grep -qxF "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
mkdir -p .tl .whl
tmp=$(mktemp -d)
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${platform[@]}" -d .whl "fla-core==0.6.0"
# TileLang's requirements the machine's image lacks (ml-dtypes, cloudpickle, psutil, tqdm are there)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" "tilelang==0.1.15" "apache-tvm-ffi==0.1.12" \
    "torch-c-dlpack-ext==0.1.5" "z3-solver==4.15.4.0"
mkdir "$tmp/x"
for w in "$tmp"/*.whl; do unzip -q -o "$w" -d "$tmp/x"; done
tar -C "$tmp/x" -cf - . | xz -T0 -6 > .tl/tl.tar.xz
rm -rf "$tmp"
ls -la .tl/tl.tar.xz .whl/fla_core-*.whl
