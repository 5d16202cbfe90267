#!/usr/bin/env bash
# CPU figures for BENCHMARKS.md, side by side in one run on the bundled pair (held-out
# prompts, greedy, 96 new tokens each, median of 3 timed rounds per configuration):
#   issue 4: plain vs frozen-KV MTP (S=3) x overlap on/off, concurrency 1 and 16
#   issue 5: plain vs MTP at concurrency 1 and 8
#   issue 2: HF transformers generate on the same target and prompts (concurrency 1)
#   issue 42: the same with decode steps eager (--disable-cuda-graph: the path before the
#     compiled CPU steps), and `tandem serve` as a user starts it: time to ready, first-token
#     latency, each process's RSS / PSS idle and under 8 streams (serve_footprint.py), and once
#     from an empty compile cache (a machine's first start: the build included)
# Decode steps run compiled (the default); a machine's first run builds them before its rounds.
# Usage: bash benchmarks/cpu_suite.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-/tmp/tandem-cpu-bench}; mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
T=models/tiny-shakespeare/target; A=models/tiny-shakespeare/assistant
P=benchmarks/prompts_shakespeare_heldout.txt
MTP=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A --speculative-num-steps 3)
run() {  # name, extra args...
  local name=$1; shift
  $PY benchmarks/offline.py --model-path $T --device cpu --prompts-file $P --output-len 96 --repeat 3 \
    --log-level warning --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || echo "$name failed"
}
for c in 1 16; do
  n=$(( c == 1 ? 4 : 32 ))
  extra=(); [ "$c" = 1 ] && extra=(--hf)
  run c${c}_plain --num-prompts $n --max-running-requests $c "${extra[@]}"
  run c${c}_mtp --num-prompts $n --max-running-requests $c "${MTP[@]}"
  run c${c}_plain_nooverlap --num-prompts $n --max-running-requests $c --disable-overlap-schedule
  run c${c}_mtp_nooverlap --num-prompts $n --max-running-requests $c "${MTP[@]}" --disable-overlap-schedule
done
run c8_plain --num-prompts 16 --max-running-requests 8
run c8_mtp --num-prompts 16 --max-running-requests 8 "${MTP[@]}"
run c1_plain_eager --num-prompts 4 --max-running-requests 1 --disable-cuda-graph
run c1_mtp_eager --num-prompts 4 --max-running-requests 1 "${MTP[@]}" --disable-cuda-graph
run c8_mtp_eager --num-prompts 16 --max-running-requests 8 "${MTP[@]}" --disable-cuda-graph
$PY benchmarks/serve_footprint.py --json "$OUT/serve.json" > "$OUT/serve.log" 2>&1 || echo "serve failed"
$PY benchmarks/serve_footprint.py --json "$OUT/serve_eager.json" -- --disable-cuda-graph > "$OUT/serve_eager.log" 2>&1 \
  || echo "serve_eager failed"
$PY benchmarks/serve_footprint.py --cold --json "$OUT/serve_cold.json" > "$OUT/serve_cold.log" 2>&1 || echo "serve_cold failed"
$PY benchmarks/summarize.py "$OUT"
$PY benchmarks/cpu_goals.py "$OUT"
