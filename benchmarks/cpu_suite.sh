#!/usr/bin/env bash
# CPU figures for BENCHMARKS.md, measured side by side in one run on the bundled pair:
# plain vs frozen-KV MTP (S=3), overlap on vs off, concurrency 1 and 16 (8 for the issue-5
# table), plus HF transformers generate on the same target and prompts.
# Usage: bash benchmarks/cpu_suite.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-/tmp/tandem-cpu-bench}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
T=models/tiny-shakespeare/target; A=models/tiny-shakespeare/assistant
P=benchmarks/prompts_shakespeare_heldout.txt
MTP=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A --speculative-num-steps 3)
run() {  # name, extra args...
  local name=$1; shift
  $PY benchmarks/offline.py --model-path $T --device cpu --prompts-file $P --output-len 64 \
    --log-level warning --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || echo "$name failed"
}
run c1_plain --num-prompts 6 --max-running-requests 1 --hf
run c1_mtp --num-prompts 6 --max-running-requests 1 "${MTP[@]}"
run c1_mtp_nooverlap --num-prompts 6 --max-running-requests 1 "${MTP[@]}" --disable-overlap-schedule
run c1_plain_nooverlap --num-prompts 6 --max-running-requests 1 --disable-overlap-schedule
for c in 8 16; do
  run c${c}_plain --num-prompts $((2 * c)) --max-running-requests $c
  run c${c}_mtp --num-prompts $((2 * c)) --max-running-requests $c "${MTP[@]}"
  run c${c}_plain_nooverlap --num-prompts $((2 * c)) --max-running-requests $c --disable-overlap-schedule
  run c${c}_mtp_nooverlap --num-prompts $((2 * c)) --max-running-requests $c "${MTP[@]}" --disable-overlap-schedule
done
$PY benchmarks/summarize.py "$OUT"
