#!/usr/bin/env bash
# The engine of another commit beside this checkout, for a code A/B on one GPU machine:
#   bash benchmarks/ab_base.sh REV [DIR]   # -> DIR (default .abbase; git-ignored if .abbase*; carry it with .whl)
#   device: ENV_VARIANTS="base:OFF_ROOT=.abbase new:" PARTS="envab gemmaab" bash benchmarks/gpu_suite.sh
# offline.py puts its own tree first on sys.path, so each variant imports its own engine.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: ab_base.sh REV [DIR]}; dir=${2:-.abbase}
rm -rf "$dir" && mkdir "$dir"
git archive "$rev" -- gpu_worker proto tandem scheduler_proc tokenizer_proc router benchmarks/offline.py \
  benchmarks/dummy_models.py pyproject.toml | tar x -C "$dir"
echo "$dir = $(git rev-parse --short "$rev") ($(du -sh "$dir" | cut -f1))"
