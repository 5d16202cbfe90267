#!/usr/bin/env bash
# The GPU tests and the published GPU benchmarks, in one call on a GPU machine, from a checkout:
#   bash benchmarks/fetch_gpu_wheels.sh      # once, where a package registry is reachable (fills .whl/)
#   bash benchmarks/gpu_suite.sh             # on the GPU machine, with .whl/ beside the checkout
# JSON and logs go under $OUT (default /tmp/tandem-gpu-out); a table with each figure beside its
# ceiling (copy bandwidth measured in the same run) is printed last and kept in summary.txt.
#
# PARTS (default "tests llama gemma qwen pair attn"):
#   tests    tests/gpu (TESTS= a subset; TESTS_STOP="" runs past a failure)
#   llama    Llama-3.1-8B shape, 1 and 64 requests, 512 in / 256 out, overlap on and off
#            (LLAMA_NO_OVERLAP=0: on only)
#   gemma    Gemma-4 9B shape, one request, plain and frozen-KV MTP S=3 (step ratio)
#   qwen     Qwen3-0.6B shape: nano-vllm's recipe (256 requests, lengths U[100, 1024]) + HF generate
#   pair     the bundled pair, plain and MTP, 1 and 8 requests
#   attn     decode attention alone against copy bandwidth
#   scale    every dummy shape (SCALE_MODELS) at 1, 64 and 256 requests, no speed flags
#   profile  a torch.profiler trace of one 8B decode step and its per-layer kernel table
#            (PROFILE_ARGS: more profile_step.py flags, e.g. "--quantization fp8")
#   moe      mixture-of-experts shapes (benchmarks/moe_suite.sh)
#   fp8      FP8 weights and KV cache beside bf16 (benchmarks/fp8_suite.sh; FP8_STAGES picks its
#            stages: tests kernels engines, all by default; fp8_summary.txt)
# BASE=DIR (benchmarks/lab/ab_base.sh REV DIR): every engine run runs twice, DIR's engine first
# (name_base.json), then this checkout's: a code A/B on the same card in the same call.
set -uo pipefail
FINAL=${OUT:-/tmp/tandem-gpu-out}; OUT=$FINAL/work; mkdir -p "$OUT"  # logs in work/, tarred at the end
PARTS=${PARTS:-"tests llama gemma qwen pair attn"}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# FlashInfer JIT-compiles on a fresh machine (~100 s per prefill variant): its cache lives in
# .fi-cache, comes back as $OUT/fi-cache/*.tgz and can be carried (unpacked, git-ignored) next time.
export FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache; mkdir -p .fi-cache
for f in .fi-cache/*.tgz; do [ -e "$f" ] && tar xzf "$f" -C .fi-cache; done
has() { [[ " $PARTS " == *" $1 "* ]] && { save; true; }; }
# What has run so far, tarred again before each part: a run cut off by a time limit still brings
# back every finished part's logs and JSON.
save() { tar czf "$FINAL/results.tgz" -C "$OUT" . 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
export DM=/tmp/tandem-dummy; python3 benchmarks/dummy_models.py $DM > /dev/null
T=models/tiny-shakespeare/target; A=models/tiny-shakespeare/assistant
LLAMA8B=(--model-path $DM/llama-3.1-8b --num-prompts 1,64 --input-len 512 --output-len 256 --max-running-requests 64)
G=(--model-path $DM/gemma4-dense-9b --num-prompts 1 --input-len 512 --output-len 128 --max-running-requests 8 --warmup-rounds 1)
MTPG=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $DM/gemma4-dense-9b-assistant --speculative-num-steps 3)
RECIPE=(--model-path $DM/qwen3-0.6b --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024
        --max-running-requests 256)
python3 benchmarks/hbm_bandwidth.py --model-path $T > "$OUT/hbm.json" && grep -m1 bandwidth "$OUT/hbm.json"

run_offline() {  # root, name, timeout, args...: benchmarks/offline.py of the engine under root
  local root=$1 name=$2 t=$3; shift 3
  timeout "$t" python3 "$root/benchmarks/offline.py" --device cuda --log-level warning --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "$name failed"; tail -5 "$OUT/$name.log"; }
}
eng() {  # name, timeout, args...: one engine run (twice with BASE: the base commit's first)
  local name=$1 t=$2; shift 2
  [ -n "${BASE:-}" ] && run_offline "$BASE" "${name}_base" "$t" "$@"
  run_offline . "$name" "$t" "$@"
}
off() { local name=$1 t=$2; shift 2; eng "$name" "$t" --load-format dummy "$@"; }  # dummy weights
export -f run_offline eng off; export OUT  # moe_suite.sh and fp8_suite.sh use them

if has tests; then
  echo "== ${TESTS:-tests/gpu}"
  # SIGINT at the limit: pytest stops as on Ctrl-C and still prints what failed so far
  timeout -s INT -k 30 ${TESTS_TIMEOUT:-480} python3 -m pytest ${TESTS:-tests/gpu} -q ${TESTS_STOP--x} -rfEs -p no:cacheprovider \
    > "$OUT/gpu_tests_full.log" 2>&1
  tail -40 "$OUT/gpu_tests_full.log" | tee "$OUT/gpu_tests.log"
fi
if has profile; then
  echo "== profile: an 8B decode step (1 request), kernel by kernel"
  timeout 120 python3 benchmarks/profile_step.py --model-path $DM/llama-3.1-8b --steps 48 ${PROFILE_ARGS:-} \
    --trace "$FINAL/trace_8b_bs1.json.gz" > "$OUT/profile_8b.txt" 2>&1 || echo "profile failed"
  python3 benchmarks/trace_layers.py "$FINAL/trace_8b_bs1.json.gz" > "$OUT/layers_8b.txt" 2>&1 && cat "$OUT/layers_8b.txt"
fi
if has llama; then
  echo "== Llama-3.1-8B shape: 1 and 64 requests, 512 in / 256 out, overlap on / off"
  [ "${LLAMA_NO_OVERLAP:-1}" = 1 ] && off llama_no_overlap 150 "${LLAMA8B[@]}" --disable-overlap-schedule --warmup-rounds 1
  off llama_overlap 150 "${LLAMA8B[@]}" --warmup-rounds 1
fi
if has gemma; then
  echo "== Gemma-4 9B shape: plain vs frozen-KV MTP S=3, one request"
  off gemma_plain 150 "${G[@]}"
  off gemma_mtp 150 "${G[@]}" "${MTPG[@]}"
fi
if has qwen; then
  echo "== Qwen3-0.6B shape: nano-vllm's recipe + HF generate; 1 and 64 requests"
  off qwen_nano 200 "${RECIPE[@]}" --hf --hf-output-len 64
  off qwen_small 150 "${LLAMA8B[@]}" --model-path $DM/qwen3-0.6b --warmup-rounds 1
fi
if has pair; then
  echo "== the bundled pair, plain and MTP, 1 and 8 requests"
  P=benchmarks/prompts_shakespeare_heldout.txt
  for mode in plain mtp; do
    extra=(); [ $mode = mtp ] && extra=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A
                                        --speculative-num-steps 3)
    eng pair_$mode 90 --model-path $T --prompts-file $P --output-len 128 --num-prompts 1,8 --max-running-requests 8 \
      --warmup-rounds 1 --repeat 5 --disable-prefix-cache "${extra[@]}"
  done
fi
if has scale; then
  SCALE_MODELS=${SCALE_MODELS:-llama-3.1-8b gemma4-dense-9b qwen3-0.6b}
  echo "== no speed flags: $SCALE_MODELS at 1 / 64 / 256 requests"
  for m in $SCALE_MODELS; do
    off scale_$m 200 --model-path $DM/$m --num-prompts 1,64,256 --input-len 512 --output-len 256 --warmup-rounds 1
  done
fi
if has attn; then
  echo "== decode attention alone"
  timeout 200 python3 benchmarks/attention_bench.py --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1 \
    || { echo "attention bench failed"; tail -5 "$OUT/attention.log"; }
fi
if has moe && [ -e benchmarks/moe_suite.sh ]; then bash benchmarks/moe_suite.sh; fi
if has fp8 && [ -e benchmarks/fp8_suite.sh ]; then bash benchmarks/fp8_suite.sh; fi
# FlashInfer's JIT cache, one tarball per built module (a run returns files of <= 16 MiB).
if [ -d .fi-cache/.cache ]; then
  mkdir -p "$FINAL/fi-cache"
  (cd .fi-cache && find .cache -mindepth 5 -maxdepth 5 -type d -path '*cached_ops/*' | while read -r d; do
     tar czf "$FINAL/fi-cache/$(basename "$d").tgz" "$d"; done
   tar czf "$FINAL/fi-cache/rest.tgz" --exclude='*/cached_ops/*' .cache)
fi
python3 benchmarks/gpu_report.py "$OUT" $DM
[ -e "$OUT/fp8_summary.txt" ] && cp "$OUT/fp8_summary.txt" "$FINAL/"
cp "$OUT/summary.txt" "$FINAL/"; tar czf "$FINAL/results.tgz" -C "$OUT" .
