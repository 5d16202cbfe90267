#!/usr/bin/env bash
# gpu_suite.sh's part "moe": mixture-of-experts targets on dummy weights (DM, OUT from the suite,
# which measured the copy bandwidth into $OUT/hbm.json first).
#   Gemma 4 26B-A4B and Qwen3-30B-A3B at 1 / 64 / 256 requests, 512 in / 256 out: decode tok/s
#   beside the step roofline of the bytes a step must read (the experts it selected, measured on
#   the device), GPU idle between steps; the 26B-A4B MTP step (S=3, its assistant) vs the plain
#   step at one request (benchmarks/moe_bench.py: table in moe.log, figures in moe.json).
# MOE_MODELS: a subset (comma list; one model per call if both do not fit one 10-minute call);
# MOE_CONFIGS: bf16 (default), fp8 (--quantization fp8: e4m3 experts and projections), or both
# ("bf16,fp8": side by side in one run); MOE_PROMPTS: the request counts (default 1,64,256);
# MOE_WARMUP: untimed rounds of each workload first (default 1; 0 saves time).
# MOE_TUNE=1 first sweeps the MoE kernels' launch shapes at each model's shape (moe_tune.py;
# MOE_TUNE_ONLY=1: only that); the entries it prints go into gpu_worker/kernels/moe_configs.json.
set -uo pipefail
MOE_MODELS=${MOE_MODELS:-gemma4-26b-a4b,qwen3-30b-a3b}
if [ "${MOE_TUNE:-0}" = 1 ]; then
  for c in ${MOE_MODELS//,/ }; do
    echo "== MoE launch shapes at the $c shape (moe_tune.py)"
    timeout ${MOE_TUNE_TIMEOUT:-280} python3 benchmarks/moe_tune.py --config benchmarks/configs/$c.json --out "$OUT" \
      --budget-s ${MOE_TUNE_BUDGET:-240} > "$OUT/moe_tune_$c.log" 2>&1 || echo "moe tune $c failed"
    grep "us," "$OUT/moe_tune_$c.log" | tail -24
  done
  [ "${MOE_TUNE_ONLY:-0}" = 1 ] && exit 0
fi
echo "== MoE: $MOE_MODELS decode vs the step roofline; the 26B-A4B MTP step vs the plain step"
timeout ${MOE_TIMEOUT:-570} python3 benchmarks/moe_bench.py --dummy-dir "$DM" --out "$OUT" --hbm-json "$OUT/hbm.json" \
  --models "$MOE_MODELS" --configs "${MOE_CONFIGS:-bf16}" --prompts "${MOE_PROMPTS:-1,64,256}" \
  --warmup-rounds ${MOE_WARMUP:-1} > "$OUT/moe.log" 2>&1 || echo "moe bench failed"
tail -20 "$OUT/moe.log"
