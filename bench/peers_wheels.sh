#!/usr/bin/env bash
# The wheels bench/peers.py needs on the GPU machine (Python 3.12, x86-64, no network), into
# .whl_peers/ (git-ignored; carry it): DeepSpeed built without its ops (its CPU Adam compiles on
# first use there) and what the machine's image lacks of its requirements.
#   bench/peers_wheels.sh && du -sh .whl_peers
# On the machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_peers/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/src:$PWD:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl_peers
grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
mkdir -p "$out"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w "$out"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# pydantic and hjson are not in the machine's image; pydantic 2.13 needs a newer typing-extensions
python3 -m pip download -q --no-deps "${platform[@]}" -d "$out" hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 "typing-extensions==4.16.0"
ls -la "$out"
