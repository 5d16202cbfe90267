#!/usr/bin/env bash
# The engine of another commit beside this checkout, for a code A/B on one GPU machine:
#   bash benchmarks/lab/ab_base.sh REV [DIR]   # -> DIR (default .abbase; git-ignored if .abbase*; carry it with .whl)
#   GPU machine: BASE=.abbase PARTS="llama gemma" bash benchmarks/gpu_suite.sh
#   (each engine part then runs twice in the same call, the base commit's engine first: *_base.json)
# offline.py puts its own tree first on sys.path, so each variant imports its own engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: ab_base.sh REV [DIR]}; dir=${2:-.abbase}
rm -rf "$dir" && mkdir "$dir"
# every top-level Python package of REV, its benchmark drivers and its pyproject (no models, tests)
pkgs=$(git ls-tree -r --name-only "$rev" | grep -E '^[a-z_]+/__init__\.py$' | cut -d/ -f1 | grep -vx tests)
git archive "$rev" -- $pkgs $(git ls-tree --name-only "$rev" benchmarks/ | grep '\.py$') pyproject.toml | tar x -C "$dir"
echo "$dir = $(git rev-parse --short "$rev") ($(du -sh "$dir" | cut -f1))"
