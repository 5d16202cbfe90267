#!/usr/bin/env bash
# Fill ./.whl with the wheels in benchmarks/gpu_requirements.txt for the GPU machine's Python
# (CPython 3.12, x86_64 manylinux). Run from a checkout on a machine with registry access.
#   bash benchmarks/fetch_gpu_wheels.sh          # download into .whl/
#   bash benchmarks/fetch_gpu_wheels.sh --list   # print the requirements it would fetch, one a line
set -euo pipefail
cd "$(dirname "$0")/.."
# One requirement a line; '#' starts a comment, also after a requirement.
requirements() { sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e 's/^[[:space:]]*//' benchmarks/gpu_requirements.txt | grep -v '^$'; }
if [ "${1:-}" = --list ]; then requirements; exit 0; fi
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
mkdir -p .whl
PLAT=()
for n in 39 35 34 31 28 27 26 24 17; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
requirements | xargs python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLAT[@]}" -d .whl
ls .whl
