#!/usr/bin/env bash
# The FP8 part of benchmarks/gpu_suite.sh (PARTS=fp8; the suite exports OUT, DM, the Python path
# and its engine-run function ``off``), stages picked by FP8_STAGES (default all three):
# tests:   tests/gpu/test_gpu_fp8.py and the FP8 unit kernel tests on CUDA (self-checking)
# kernels: benchmarks/fp8_gemm_bench.py (FP8 GEMV vs bf16 at 1-4 rows; FP8 GEMM vs bf16 cuBLAS
#          vs torch._scaled_mm at 16-8192 rows: which GEMM wins; FP8_BENCH_ONLY=gemv or gemm)
# engines: dummy weights, each in bf16 / FP8 weights / FP8 weights + FP8 KV: the 8B shape at 1 and
#          64 requests (512 in / 256 out) plus a prefill-bound round (16 x 2048), and the Gemma-4
#          9B shape + its assistant (MTP S=3) at one request; then benchmarks/fp8_report.py's
#          table: step roofline per row, KV pool tokens, the goals PASS / MISS.
# About 2 + 2 + 6 minutes on an H100 (six engine starts); FP8_CONFIGS and FP8_MODELS ("llama gemma")
# narrow the engine runs.
set -uo pipefail
: "${OUT:?run through benchmarks/gpu_suite.sh (PARTS=fp8)}" "${DM:?}"
STAGES=${FP8_STAGES:-"tests kernels engines"}
CONFIGS=${FP8_CONFIGS:-"bf16 fp8 fp8kv"}
MODELS=${FP8_MODELS:-"llama gemma"}
flags() {  # config name -> engine flags
  case $1 in
    bf16) ;;
    fp8) echo "--quantization fp8" ;;
    fp8kv) echo "--quantization fp8 --kv-cache-dtype fp8_e4m3" ;;
  esac
}
if [[ " $STAGES " == *" tests "* ]]; then
  echo "== FP8 GPU tests"
  timeout ${FP8_TESTS_TIMEOUT:-300} python3 -m pytest -q -x -rf -p no:cacheprovider tests/gpu/test_gpu_fp8.py \
    tests/unit/gpu_worker/kernels/test_kernels_fp8.py tests/unit/gpu_worker/kernels/test_kv_fp8.py > "$OUT/fp8_tests_full.log" 2>&1
  tail -15 "$OUT/fp8_tests_full.log" | tee "$OUT/fp8_tests.log"
fi
if [[ " $STAGES " == *" kernels "* ]]; then
  echo "== FP8 GEMV / GEMM vs bf16 (and torch._scaled_mm)"
  timeout ${FP8_BENCH_TIMEOUT:-300} python3 benchmarks/fp8_gemm_bench.py --json "$OUT/fp8_gemm_bench.json" --only ${FP8_BENCH_ONLY:-gemv,gemm} \
    > "$OUT/fp8_gemm_bench.log" 2>&1 || { echo "fp8 gemm bench failed"; tail -5 "$OUT/fp8_gemm_bench.log"; }
  grep "^decision" "$OUT/fp8_gemm_bench.log"
fi
if [[ " $STAGES " == *" engines "* ]]; then
  echo "== FP8 engines: 8B at 1 / 64 requests + prefill, Gemma-4 9B + assistant MTP: $CONFIGS"
  for c in $CONFIGS; do
    [[ " $MODELS " == *" llama "* ]] || continue
    off fp8_llama_$c 170 --model-path $DM/llama-3.1-8b --num-prompts 1,64 --input-len 512 --output-len 256 \
      --max-running-requests 64 --warmup-rounds 1 --prefill-prompts 16 --prefill-len 2048 $(flags $c)
  done
  for c in $CONFIGS; do
    [[ " $MODELS " == *" gemma "* ]] || continue
    off fp8_gemma_$c 170 --model-path $DM/gemma4-dense-9b --num-prompts 1 --input-len 512 --output-len 128 \
      --max-running-requests 8 --warmup-rounds 1 --speculative-algorithm FROZEN-KV-MTP \
      --speculative-draft-model-path $DM/gemma4-dense-9b-assistant --speculative-num-steps 3 $(flags $c)
  done
  python3 benchmarks/fp8_report.py "$OUT" "$DM"
fi
