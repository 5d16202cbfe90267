#!/usr/bin/env bash
# Everything that needs the H200, in one device call, from a fresh checkout:
#   bash benchmarks/fetch_gpu_wheels.sh   # once, where a registry is reachable (fills .whl/)
#   device run: carry [".whl"], command: bash benchmarks/gpu_suite.sh
# tests/gpu first, then the benchmarks of issue 8 (a-f); JSON + logs under $OUT; a table last.
# PARTS selects stages (default all): tests profile llama qwen gemma pair attn
set -uo pipefail
OUT=${OUT:-/tmp/tandem-gpu-out}; mkdir -p "$OUT"
PARTS=${PARTS:-"tests profile llama qwen gemma pair attn"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d .fi-cache ] && export FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
DM=/tmp/tandem-dummy; python3 benchmarks/dummy_models.py $DM > /dev/null
T=models/tiny-shakespeare/target; A=models/tiny-shakespeare/assistant
python3 benchmarks/hbm_bandwidth.py --model-path $T > "$OUT/hbm.json" && grep -m1 bandwidth "$OUT/hbm.json"

if has tests; then
  echo "== tests/gpu"
  timeout 200 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
fi
if has profile; then
  echo "== profile: one 8B decode step (1 request, 512-token prompt)"
  timeout 120 python3 benchmarks/profile_step.py --model-path $DM/llama-3.1-8b --steps 48 \
    > "$OUT/profile_8b.txt" 2>&1 || echo "profile failed"
  head -8 "$OUT/profile_8b.txt"
fi
off() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 benchmarks/offline.py --device cuda --load-format dummy --log-level warning \
    --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name failed"; tail -5 "$OUT/$name.log"; }
}
if has llama; then
  echo "== (a, b, d) Llama-3.1-8B shape: 1 and 64 requests, 512 in / 256 out, overlap on / off"
  off llama_overlap 150 --model-path $DM/llama-3.1-8b --num-prompts 1,64 --input-len 512 --output-len 256 \
    --max-running-requests 64
  off llama_no_overlap 150 --model-path $DM/llama-3.1-8b --num-prompts 1,64 --input-len 512 --output-len 256 \
    --max-running-requests 64 --disable-overlap-schedule
fi
if has qwen; then
  echo "== (c) Qwen3-0.6B shape, nano-vllm recipe (256 requests, lengths U[100, 1024]) + HF generate"
  off qwen_nano 200 --model-path $DM/qwen3-0.6b --num-prompts 256 --input-len-range 100 1024 \
    --output-len-range 100 1024 --max-running-requests 256 --hf --hf-output-len 64
fi
if has gemma; then
  echo "== (e) Gemma-4-shaped 9B dense target: plain vs frozen-KV MTP S=3 (dummy weights), 1 request"
  MTPG=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $DM/gemma4-dense-9b-assistant --speculative-num-steps 3)
  off gemma_plain 150 --model-path $DM/gemma4-dense-9b --num-prompts 1 --input-len 512 --output-len 128 --max-running-requests 8
  off gemma_mtp 150 --model-path $DM/gemma4-dense-9b --num-prompts 1 --input-len 512 --output-len 128 --max-running-requests 8 "${MTPG[@]}"
fi
if has pair; then
  echo "== (e) bundled pair, MTP on / off, 1 and 8 requests"
  P=benchmarks/prompts_shakespeare_heldout.txt
  MTP=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A --speculative-num-steps 3)
  for mode in plain mtp; do
    extra=(); [ $mode = mtp ] && extra=("${MTP[@]}")
    timeout 90 python3 benchmarks/offline.py --model-path $T --device cuda --prompts-file $P --output-len 128 \
      --num-prompts 1,8 --max-running-requests 8 --log-level warning --json "$OUT/pair_$mode.json" "${extra[@]}" \
      > "$OUT/pair_$mode.log" 2>&1 || echo "pair_$mode failed"
  done
fi
if has attn; then
  echo "== (f) decode attention alone"
  timeout 200 python3 benchmarks/attention_bench.py --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1 \
    || { echo "attention bench failed"; tail -5 "$OUT/attention.log"; }
fi
if [ -d "${FLASHINFER_WORKSPACE_BASE:-/nonexistent}" ] || [ -d ~/.cache/flashinfer ]; then
  src=${FLASHINFER_WORKSPACE_BASE:+$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer}; src=${src:-~/.cache/flashinfer}
  [ -d "$src" ] && tar czf "$OUT/fi-cache.tgz" -C "$(dirname "$src")" flashinfer 2>/dev/null
fi
python3 benchmarks/gpu_report.py "$OUT" $DM
