#!/usr/bin/env bash
# Everything that needs the H200, in one device call, from a fresh checkout:
#   bash benchmarks/fetch_gpu_wheels.sh   # once, where a registry is reachable (fills .whl/)
#   device run: carry [".whl"], command: bash benchmarks/gpu_suite.sh
# tests/gpu first, then the benchmarks of issue 8 (a-f); JSON + logs under $OUT; a table last.
# PARTS selects stages (default all): tests profile llama qwen gemma pair attn
# (PROFILE_PREFILL=0: the profile part profiles only the 1-request decode step)
# (and, not in the default: fi = flashinfer vs triton; fuse = the one-row MLP fusions and PDL, A/B;
#  gfuse = the same on the Gemma-4 9B shape;
#  rows = the GEMV's tensor-core variant (1-4 rows) and the greedy tail: sweep, engine A/B, tests;
#  envab = the 8B at 1 and 64 requests (ENVAB_PROMPTS) once per ENV_VARIANTS entry ("name:VAR=v,VAR=v ...";
#          ENVAB_MODEL=qwen3-0.6b: another dummy shape); gemmaab = (e) per ENV_VARIANTS entry;
#          an entry with OFF_ROOT=.abbase runs the engine of another commit (benchmarks/ab_base.sh REV,
#          then carry .abbase too): a code A/B on one machine;
#  pdlprof = one 8B decode layer's kernels and the gaps between them, PDL off and on (trace_layers.py;
#            PDLPROF_LEVELS="1": on only);
#  mtpprof = (e)'s MTP step on the Gemma-4 9B + assistant at one request, kernel by kernel (the draft
#            loop's share: profile_step.py --draft), trace under $OUT;
#  lpt = decode rows launched longest first, A/B; sweep = kernel_sweep.py's logits and GEMM parts;
#  transient = the recipe's first round in fresh processes, Triton variants logged, lazy vs eager;
#  chunk = the recipe's first round in fresh processes at 8192 / 16384 / 32768 tokens a step,
#          and a profile of a recipe-sized decode step;
#  host = one 8192-token prefill step's wall time and host profile (cProfile), piecewise graphs on / off;
#  (profile: PROFILE_DECODE_BATCHES="64" adds decode-only profiles at those row counts;
#   sweep: SWEEP_ONLY="attn" etc. picks kernel_sweep.py's parts)
#  depth = --overlap-depth 2 vs 3 (DEPTHS) on the bundled pair and Qwen3-0.6B (host-bound shapes);
#  scale = every dummy shape (SCALE_MODELS) at 1, 64 and 256 requests with no speed flags;
#  tune = the recipe and the 8B at 64 requests with the decode kernel's launch shape varied,
#         TANDEM_DECODE_TUNE, fresh processes;
#  fp8tests, fp8kernels, fp8 = benchmarks/fp8_suite.sh's stages: the FP8 GPU tests; FP8 GEMV / GEMM
#         vs bf16 and torch._scaled_mm; the 8B and Gemma-4 9B + assistant engines in bf16 / FP8 /
#         FP8 + FP8 KV with step rooflines, KV pool tokens and the FP8 goals (fp8_summary.txt))
set -uo pipefail
FINAL=${OUT:-/tmp/tandem-gpu-out}; OUT=$FINAL/work; mkdir -p "$OUT"  # logs in work/, tarred at the end
PARTS=${PARTS:-"tests profile llama gemma qwen pair attn"}
export TANDEM_HOST_TIMING=${TANDEM_HOST_TIMING:-1}  # worker logs host ms/step by loop phase
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# FlashInfer JIT-compiles on a fresh machine (~100 s per prefill variant): its cache lives in
# .fi-cache, comes back as $OUT/fi-cache/*.tgz and is carried (unpacked, git-ignored) next time.
export FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache; mkdir -p .fi-cache
for f in .fi-cache/*.tgz; do [ -e "$f" ] && tar xzf "$f" -C .fi-cache; done  # carried tarballs
has() { [[ " $PARTS " == *" $1 "* ]] && { [ -z "${DONE_PART:-}" ] || save; DONE_PART=$1; }; }
# What has run so far, tarred again before each part: a call cut off by its time limit still
# brings back every finished part's logs and JSON.
save() { tar czf "$FINAL/results.tgz" -C "$OUT" . 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
DM=/tmp/tandem-dummy; python3 benchmarks/dummy_models.py $DM > /dev/null
T=models/tiny-shakespeare/target; A=models/tiny-shakespeare/assistant
# The two workloads every A/B part re-runs: (a, b) the 8B shape at 1 and 64 requests, and (c)
# nano-vllm's recipe on the Qwen3-0.6B shape (256 requests, lengths U[100, 1024]).
LLAMA8B=(--model-path $DM/llama-3.1-8b --num-prompts 1,64 --input-len 512 --output-len 256 --max-running-requests 64)
# (e) the Gemma-4-shaped 9B dense target at one request, plain and with frozen-KV MTP S=3
G=(--model-path $DM/gemma4-dense-9b --num-prompts 1 --input-len 512 --output-len 128 --max-running-requests 8 --warmup-rounds 1)
MTPG=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $DM/gemma4-dense-9b-assistant --speculative-num-steps 3)
RECIPE=(--model-path $DM/qwen3-0.6b --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024
        --max-running-requests 256)
python3 benchmarks/hbm_bandwidth.py --model-path $T > "$OUT/hbm.json" && grep -m1 bandwidth "$OUT/hbm.json"

in_env() {  # "VAR=v,VAR=v" (an ENV_VARIANTS entry's list), command...: the command with those set
  local vars=$1; shift
  (for kv in ${vars//,/ }; do export "$kv"; done; "$@")
}
off() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 ${OFF_ROOT:-.}/benchmarks/offline.py --device cuda --load-format dummy --log-level warning \
    --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name failed"; tail -5 "$OUT/$name.log"; }
}
if has tests; then
  echo "== ${TESTS:-tests/gpu}"  # TESTS: a subset (test files), for A/B calls
  # TESTS_STOP="" runs every test past a failure (default -x: stop at the first); the whole
  # output stays in gpu_tests_full.log, its end (the failures' summary lines) in gpu_tests.log
  timeout ${TESTS_TIMEOUT:-480} python3 -m pytest ${TESTS:-tests/gpu} -q ${TESTS_STOP--x} -rf -p no:cacheprovider \
    > "$OUT/gpu_tests_full.log" 2>&1
  tail -40 "$OUT/gpu_tests_full.log" | tee "$OUT/gpu_tests.log"
fi
if has chunk; then
  # Eager prefill steps spend about as much host time as kernel time at 8192 tokens (Qwen3-0.6B):
  # a larger step budget halves their number. A fresh process each, first round (as a user sees).
  echo "== prefill step budget: Qwen3 recipe, first round, --chunked-prefill-size A/B"
  # Runs before the other engine parts: with CHUNKS=default, the machine's first engine process
  # serves the recipe with no speed flags, as a checker's first run on a fresh machine would.
  for c in ${CHUNKS:-8192 16384 8192 16384 32768}; do
    n=qwen_chunk$c; [ -e "$OUT/$n.json" ] && n=${n}_b
    flag=(--chunked-prefill-size $c); [ $c = default ] && flag=()
    [ $c = eager ] && flag=(--disable-piecewise-cuda-graph)  # CHUNKS=eager: prefill steps without graphs
    off $n 200 "${RECIPE[@]}" "${flag[@]}"
    python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['engine']; print(sys.argv[2], 'tok/s %.0f' % w['output_tok_s'],
      'steps', w['steps'], 'decode ms/step %.3f' % w['decode_busy_ms_per_step'], 'wall %.3f s' % w['wall_s'])" \
      "$OUT/$n.json" $n 2>/dev/null
  done
  if [ "${CHUNK_PROFILE:-1}" = 1 ]; then
    timeout 120 python3 benchmarks/profile_step.py --model-path $DM/qwen3-0.6b --decode-only --batch 256 --input-len 900 \
      --steps 24 > "$OUT/profile_qwen_decode256.txt" 2>&1 || echo "profile qwen decode failed"
    grep -A4 '"steps"' "$OUT/profile_qwen_decode256.txt"
  fi
fi
if has host; then
  # One prefill step of 8 x 1024 tokens on Qwen3-0.6B (host-bound when eager), piecewise graphs
  # on (default) and off: wall time, start-up lines, the host's top functions (cProfile).
  echo "== host side of a prefill step: Qwen3-0.6B 8 x 1024 tokens, piecewise graphs on / off; 8B 16 x 512"
  for v in on off; do
    flag=(); [ $v = off ] && flag=(--disable-piecewise-cuda-graph)
    timeout 150 python3 benchmarks/profile_step.py --model-path $DM/qwen3-0.6b --batch 8 --input-len 1024 --cprofile \
      "${flag[@]}" > "$OUT/host_qwen_prefill_$v.txt" 2>&1 || echo "host profile qwen $v failed"
  done
  timeout 150 python3 benchmarks/profile_step.py --model-path $DM/llama-3.1-8b --batch 16 --input-len 512 --cprofile \
    > "$OUT/host_8b_prefill_on.txt" 2>&1 || echo "host profile 8b failed"
  for f in host_qwen_prefill_on host_qwen_prefill_off host_8b_prefill_on; do echo "$f"
    grep "CUDA graphs\|prefill warm-up" "$OUT/$f.txt" | cut -c1-220; grep -m1 prefill_plus "$OUT/$f.txt"
    grep -A12 "Ordered by: internal" "$OUT/$f.txt" | tail -10 | cut -c1-150; done
fi
if has profile; then
  # Decode at 1 request (the 8B step), then one prefill step of 8192 tokens on each model.
  # (profile_step.py --decode-only --batch 64 / 256 profiles big-batch decode steps;
  # kernel_sweep.py times attention and the GEMMs alone.)
  echo "== profile: an 8B decode step (1 request), a prefill step of 8192 tokens (8B and Qwen3-0.6B)"
  timeout 120 python3 benchmarks/profile_step.py --model-path $DM/llama-3.1-8b --steps 48 \
    --trace "$FINAL/trace_8b_bs1.json.gz" > "$OUT/profile_8b.txt" 2>&1 || echo "profile failed"
  python3 benchmarks/trace_layers.py "$FINAL/trace_8b_bs1.json.gz" > "$OUT/layers_8b.txt" 2>&1 && cat "$OUT/layers_8b.txt"
  if [ "${PROFILE_PREFILL:-1}" = 1 ]; then  # PROFILE_PREFILL=0: the decode step only
    timeout 120 python3 benchmarks/profile_step.py --model-path $DM/llama-3.1-8b --steps 1 --batch 16 \
      > "$OUT/profile_8b_prefill.txt" 2>&1 || echo "profile 8b prefill failed"
    timeout 120 python3 benchmarks/profile_step.py --model-path $DM/qwen3-0.6b --steps 1 --batch 8 --input-len 1024 \
      > "$OUT/profile_qwen_prefill.txt" 2>&1 || echo "profile qwen prefill failed"
  fi
  PM=${PROFILE_DECODE_MODEL:-llama-3.1-8b}  # the shape of the decode-only profiles
  for b in ${PROFILE_DECODE_BATCHES:-}; do  # e.g. "64": decode-only steps at that many rows
    timeout 150 python3 benchmarks/profile_step.py --model-path $DM/$PM --decode-only --batch $b --steps 24 \
      --trace "$FINAL/trace_${PM}_bs$b.json.gz" > "$OUT/profile_${PM}_bs$b.txt" 2>&1 || echo "profile bs$b failed"
    python3 benchmarks/trace_layers.py "$FINAL/trace_${PM}_bs$b.json.gz" > "$OUT/layers_${PM}_bs$b.txt" 2>&1 \
      && cat "$OUT/layers_${PM}_bs$b.txt"; grep -A4 '"steps"' "$OUT/profile_${PM}_bs$b.txt"
  done
  for f in profile_8b profile_8b_prefill profile_qwen_prefill; do [ -e "$OUT/$f.txt" ] || continue
    echo "$f"; grep -A4 '"steps"' "$OUT/$f.txt"; done
fi
if has pdlprof; then
  # One decode layer of the 8B at one row, PDL off and on: mean kernel times and the gap before
  # each (negative = it started before its predecessor ended; read trace_layers.py's "adds").
  # PDL is on by default at <= 4 tokens since 2026-12-04 (BENCHMARKS.md).
  # PDLPROF_MODEL: another dummy shape (e.g. qwen3-0.6b, whose one-request step is launch-bound)
  echo "== the ${PDLPROF_MODEL:-llama-3.1-8b} one-row decode layer, TANDEM_PDL=${PDLPROF_LEVELS:-0 1}"
  for p in ${PDLPROF_LEVELS:-0 1}; do
    TANDEM_PDL=$p timeout 120 python3 benchmarks/profile_step.py --model-path $DM/${PDLPROF_MODEL:-llama-3.1-8b} --steps 48 \
      --trace "$OUT/trace_pdl$p.json.gz" > "$OUT/profile_pdl$p.txt" 2>&1 || echo "profile PDL=$p failed"
    echo "TANDEM_PDL=$p"; python3 benchmarks/trace_layers.py "$OUT/trace_pdl$p.json.gz" 2>&1 | tee "$OUT/layers_pdl$p.txt"
  done
fi
if has mtpprof; then
  # Where the MTP step's time goes beyond the plain step's: the draft loop (1.04 ms at S=3 on
  # 2026-12-04, its floor ~0.4 ms: three 537 MB LM heads) and the verify forward at 4 rows.
  echo "== Gemma-4 9B + assistant, S=3, one request: the MTP decode step's kernels"
  timeout 240 python3 benchmarks/profile_step.py --model-path $DM/gemma4-dense-9b \
    --draft $DM/gemma4-dense-9b-assistant --decode-only --steps 24 --trace "$OUT/trace_mtp.json.gz" \
    > "$OUT/profile_mtp.txt" 2>&1 || echo "profile mtp failed"
  head -45 "$OUT/profile_mtp.txt"
fi
if has llama; then
  echo "== (a, b, d) Llama-3.1-8B shape: 1 and 64 requests, 512 in / 256 out, overlap on / off"
  # One untimed round of each workload first: the first seconds of an engine process are slow
  # (BENCHMARKS.md, "start-up transient").
  off llama_no_overlap 150 "${LLAMA8B[@]}" --disable-overlap-schedule --warmup-rounds 1
  off llama_overlap 150 "${LLAMA8B[@]}" --warmup-rounds 1
fi
if has fi; then
  echo "== attention backends side by side: flashinfer vs triton (8B 1 / 64 requests, Qwen3 recipe)"
  for be in flashinfer triton; do
    off llama_$be 150 "${LLAMA8B[@]}" --warmup-rounds 1 --attention-backend $be
    off qwen_nano_$be 150 "${RECIPE[@]}" --warmup-rounds 1 --attention-backend $be
  done
  for f in "$OUT"/llama_{flashinfer,triton}.json "$OUT"/qwen_nano_{flashinfer,triton}.json; do
    [ -e "$f" ] && python3 -c "import json,sys; [print(sys.argv[1].split('/')[-1], w['num_prompts'], 'tok/s %.1f' % w['output_tok_s'],
      'decode tok/s %.1f' % w.get('decode_tok_s', 0), 'busy ms/step %.3f' % w['busy_ms_per_step'])
      for w in json.load(open(sys.argv[1]))['workloads']]" "$f"
  done
fi
if has fuse; then
  # The one-row MLP: gated gate_up GEMV (activation in its epilogue) and a split-K down GEMV
  # (one kernel, deterministic) vs the act kernel + cuBLAS split-K pair; PDL on top.
  echo "== one-row decode chain: layer-chain bench, 8B engine A/B (fusions off / on / + PDL), GPU tests"
  timeout 150 python3 benchmarks/layer_chain_bench.py --json "$OUT/layer_chain.json" > "$OUT/layer_chain.log" 2>&1 \
    || echo "layer chain bench failed"
  tail -14 "$OUT/layer_chain.log"
  # gated GEMV, split-K down splits, PDL, split-KV merged in the decode kernel: all off (the chain
  # before 2026-12-03), the MLP fusions, those without PDL, with PDL (the default since 2026-12-04)
  for v in ${FUSE_VARIANTS:-0,0,0,0 1,4,0,0 1,4,0,1 1,4,1,1}; do
    set -- ${v//,/ }; export TANDEM_GATED_GEMV=$1 TANDEM_GEMV_SPLITK=$2 TANDEM_PDL=$3 TANDEM_DECODE_FUSED_MERGE=$4
    n=llama1_fuse_$1_$2_$3_$4
    off $n 150 "${LLAMA8B[@]}" --num-prompts 1 --warmup-rounds 1
    python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['workloads'][0]; print(sys.argv[2],
      'tok/s %.1f' % w['output_tok_s'], 'decode tok/s %.1f' % w.get('decode_tok_s', 0),
      'decode ms/step %.3f' % w.get('decode_busy_ms_per_step', 0))" "$OUT/$n.json" \
      "gated=$1 splitk=$2 pdl=$3 merge=$4" 2>/dev/null
  done
  unset TANDEM_GATED_GEMV TANDEM_GEMV_SPLITK TANDEM_PDL TANDEM_DECODE_FUSED_MERGE
  # (with PARTS containing tests, tests/gpu already ran these: FUSE_TESTS=0 skips them here)
  [ "${FUSE_TESTS:-1}" = 1 ] && timeout ${FUSE_TESTS_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_decode_chain.py \
    "tests/gpu/test_gpu_parity.py::test_inproc_mtp_parity_cuda[True]" \
    "tests/gpu/test_gpu_parity.py::test_inproc_parity_cuda[True-gemma4]" 2>&1 | tail -15 | tee "$OUT/fuse_tests.log"
fi
if has lpt; then
  echo "== decode launch order (longest row first): the kernel alone, the Qwen3 recipe A/B, GPU tests"
  timeout 120 python3 benchmarks/launch_order_bench.py --json "$OUT/launch_order.json" > "$OUT/launch_order.log" 2>&1 \
    || echo "launch order bench failed"
  tail -8 "$OUT/launch_order.log"
  for v in 0 1; do
    export TANDEM_DECODE_LPT=$v
    off qwen_nano_lpt$v 200 "${RECIPE[@]}" --warmup-rounds 1
  done
  unset TANDEM_DECODE_LPT
  timeout ${LPT_TESTS_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_launch_order.py \
    2>&1 | tail -15 | tee "$OUT/lpt_tests.log"
fi
if has sweep; then
  # SWEEP_ONLY picks kernel_sweep.py's parts (logits, gemm, gemv, attn, wide, narrow); SWEEP_ROTATE_MB=0 leaves weights in L2
  echo "== kernel sweep: ${SWEEP_ONLY:-logits,gemm}"
  timeout ${SWEEP_TIMEOUT:-200} python3 benchmarks/kernel_sweep.py --only ${SWEEP_ONLY:-logits,gemm} \
    --json "$OUT/kernel_sweep.json" > "$OUT/kernel_sweep.log" 2>&1 || { echo "kernel sweep failed"; tail -5 "$OUT/kernel_sweep.log"; }
  grep "^logits\|^gemm\|^gemv\|^attn " "$OUT/kernel_sweep.log"  # not the per-row attn-row lines
fi
if has transient; then
  # The recipe's first round in fresh processes (no warm-up round), every Triton variant the
  # serving path specialises logged; CUDA's lazy module loading (default) against eager.
  echo "== start-up transient: Qwen3 recipe, first round only: lazy / eager / lazy module loading"
  export TANDEM_LOG_COMPILES=1
  for v in lazy1 eager lazy2; do
    [ $v = eager ] && export CUDA_MODULE_LOADING=EAGER
    off qwen_first_$v 200 "${RECIPE[@]}"
    unset CUDA_MODULE_LOADING
  done
  unset TANDEM_LOG_COMPILES
  for v in lazy1 eager lazy2; do
    echo "$v: $(grep -c 'specialised while serving' "$OUT/qwen_first_$v.log") variants specialised while serving"
    grep 'specialised while serving' "$OUT/qwen_first_$v.log" | cut -c1-230 | head -6
  done
fi
if has tune; then
  # kernel_sweep.py picked the decode kernel's launch shape on uniform lengths; the recipe mixes
  # 100 to 2048 keys a row. Each shape in a fresh process (first round), default first.
  echo "== decode kernel launch shape on served mixes: Qwen3 recipe, 8B 64 requests (TANDEM_DECODE_TUNE)"
  i=0
  for cfg in ${TUNES:-"" "block_n=32" "num_stages=2" "block_n=32,num_stages=4" "block_n=128,num_warps=8,num_stages=2"}; do
    [ "$cfg" = '""' ] && cfg=""
    export TANDEM_DECODE_TUNE=$cfg; i=$((i + 1))
    off qwen_tune$i 200 "${RECIPE[@]}"
    off llama64_tune$i 150 --model-path $DM/llama-3.1-8b --num-prompts 64 --input-len 512 --output-len 256 \
      --max-running-requests 64
    for f in qwen_tune$i llama64_tune$i; do python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['engine']
print(sys.argv[2], repr(sys.argv[3]), 'tok/s %.0f' % w['output_tok_s'], 'decode ms/step %.3f' % w['decode_busy_ms_per_step'])" \
      "$OUT/$f.json" $f "$cfg" 2>/dev/null || echo "$f ($cfg) failed"; done
  done
  unset TANDEM_DECODE_TUNE
fi
if has gfuse; then
  # The same fusions on the Gemma-4-9B shape (hidden 3840, intermediate 15360, gelu-tanh,
  # head dims 256/512): chain bench and plain decode at one request, A/B per fusion.
  echo "== one-row decode chain on the Gemma-4 9B shape: chain bench, plain-decode A/B"
  # GFUSE_BENCH=0 skips the two chain benches, GFUSE_LLAMA=0 the Llama engine runs (short calls)
  [ "${GFUSE_BENCH:-1}" = 1 ] && timeout 150 python3 benchmarks/layer_chain_bench.py --shape gemma4-9b --json "$OUT/layer_chain_gemma.json" \
    > "$OUT/layer_chain_gemma.log" 2>&1 || echo "layer chain bench (gemma) failed"
  tail -14 "$OUT/layer_chain_gemma.log"
  [ "${GFUSE_BENCH:-1}" = 1 ] && timeout 150 python3 benchmarks/layer_chain_bench.py --json "$OUT/layer_chain.json" > "$OUT/layer_chain.log" 2>&1 \
    || echo "layer chain bench failed"
  tail -14 "$OUT/layer_chain.log"
  # gated GEMV, split-K down splits, in-kernel merge, PDL
  for v in ${GFUSE_VARIANTS:-0,0,0,0 1,0,1,0 0,4,1,0 1,4,1,0 1,4,1,1}; do
    set -- ${v//,/ }; export TANDEM_GATED_GEMV=$1 TANDEM_GEMV_SPLITK=$2 TANDEM_DECODE_FUSED_MERGE=$3 TANDEM_PDL=$4
    n=gemma1_fuse_$1_$2_$3_$4
    off $n 150 "${G[@]}"
    python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['workloads'][0]; print(sys.argv[2],
      'tok/s %.1f' % w['output_tok_s'], 'decode ms/step %.3f' % w.get('decode_busy_ms_per_step', 0))" \
      "$OUT/$n.json" "gemma gated=$1 splitk=$2 merge=$3 pdl=$4" 2>/dev/null
  done
  unset TANDEM_GATED_GEMV TANDEM_GEMV_SPLITK TANDEM_DECODE_FUSED_MERGE
  for p in $([ "${GFUSE_LLAMA:-1}" = 1 ] && echo 0 1); do  # (a) without PDL, and with it (the default since 2026-12-04)
    export TANDEM_PDL=$p
    off llama1_default_pdl$p 150 "${LLAMA8B[@]}" --num-prompts 1 --warmup-rounds 1
    python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['workloads'][0]; print(sys.argv[2],
      'tok/s %.1f' % w['output_tok_s'], 'decode tok/s %.1f' % w.get('decode_tok_s', 0),
      'decode ms/step %.3f' % w.get('decode_busy_ms_per_step', 0))" "$OUT/llama1_default_pdl$p.json" \
      "llama 1 request, defaults, pdl=$p" 2>/dev/null
  done
  unset TANDEM_PDL
fi
if has rows; then
  # The GEMV's tensor-core variant at one to four rows (MTP's verify at one request runs four)
  # and the greedy tail in the decode graphs, against the path before them (cuBLAS above one
  # row, the FMA kernel at one, eager token selection): kernel sweep, engine A/B, GPU tests.
  echo "== tensor-core GEMV and greedy tail: kernel sweep (1, 2, 4 rows), engine A/B, GPU tests"
  timeout ${ROWS_SWEEP_TIMEOUT:-240} python3 benchmarks/kernel_sweep.py --only gemv --json "$OUT/gemv_rows.json" \
    > "$OUT/gemv_rows.log" 2>&1 || { echo "gemv sweep failed"; tail -5 "$OUT/gemv_rows.log"; }
  grep "^gemv" "$OUT/gemv_rows.log"
  ab() {  # name, TANDEM_GEMV_ROWS, TANDEM_GEMV_DOT, TANDEM_GREEDY_TAIL, then offline.py's arguments
    local name=$1; export TANDEM_GEMV_ROWS=$2 TANDEM_GEMV_DOT=$3 TANDEM_GREEDY_TAIL=$4; shift 4
    off $name 150 "$@"
    python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['engine']; print(sys.argv[2], 'tok/s %.1f' % w['output_tok_s'],
      'busy ms/step %.3f' % w['busy_ms_per_step'], 'decode busy ms/step %.3f' % w.get('decode_busy_ms_per_step', 0),
      'draft ms/step %.3f' % w.get('draft_ms_per_step', 0))" "$OUT/$name.json" \
      "$name rows=$TANDEM_GEMV_ROWS dot=$TANDEM_GEMV_DOT tail=$TANDEM_GREEDY_TAIL" 2>/dev/null || echo "$name failed"
  }
  for v in ${ROWS_VARIANTS:-1,0,0 4,1,1}; do  # before, default
    set -- ${v//,/ }; r=$1 d=$2 t=$3
    ab gemma_mtp_r${r}_d${d}_t$t $r $d $t "${G[@]}" "${MTPG[@]}"
    ab gemma_plain_r${r}_d${d}_t$t $r $d $t "${G[@]}"
    ab llama1_r${r}_d${d}_t$t $r $d $t "${LLAMA8B[@]}" --num-prompts 1 --warmup-rounds 1
  done
  unset TANDEM_GEMV_ROWS TANDEM_GEMV_DOT TANDEM_GREEDY_TAIL
  [ "${ROWS_TESTS:-1}" = 1 ] && timeout ${ROWS_TESTS_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_gpu_verify_rows.py tests/gpu/test_gpu_parity.py -k "several_rows or mtp_engine or inproc" \
    2>&1 | tail -15 | tee "$OUT/rows_tests.log"
fi
if has envab; then
  # The 8B workloads (1 and 64 requests) once per ENV_VARIANTS entry, "name:VAR=v,VAR=v" (an
  # empty list after the colon = the defaults), each in a fresh process: an engine A/B of any
  # TANDEM_* switch on the same machine.
  echo "== 8B 1 / 64 requests, A/B over environment switches"
  # ENVAB_MODELS="llama-3.1-8b qwen3-0.6b": each shape in turn (files llama_env_<variant>_<shape>)
  models=${ENVAB_MODELS:-${ENVAB_MODEL:-llama-3.1-8b}}
  for m in $models; do for v in ${ENV_VARIANTS:-default:}; do
    name=${v%%:*}; vars=${v#*:}; [ "$models" = "$m" ] || name=${name}_$m
    in_env "$vars" off llama_env_$name 150 "${LLAMA8B[@]}" --warmup-rounds 1 --num-prompts "${ENVAB_PROMPTS:-1,64}" \
      --model-path $DM/$m
    python3 -c "import json,sys; [print(sys.argv[2], w['num_prompts'], 'req: decode ms/step %.3f' % w['decode_busy_ms_per_step'],
      'decode tok/s %.1f' % w['decode_tok_s'], 'tok/s %.1f' % w['output_tok_s'], 'idle %.2f%%' % (100 * w['gpu_idle_frac']))
      for w in json.load(open(sys.argv[1]))['workloads']]" \
      "$OUT/llama_env_$name.json" "$name ($vars)" 2>/dev/null || echo "$name failed"
  done; done
fi
if has gemmaab; then
  # (e) once per ENV_VARIANTS entry (as envab), plain and MTP on the same machine: the ratio per variant
  echo "== (e) Gemma-4 9B plain vs MTP S=3, A/B over environment switches"
  for v in ${ENV_VARIANTS:-default:}; do
    name=${v%%:*}; vars=${v#*:}
    in_env "$vars" off gemma_plain_$name 150 "${G[@]}"
    in_env "$vars" off gemma_mtp_$name 150 "${G[@]}" "${MTPG[@]}"
    python3 -c "import json,sys; p, m = (json.load(open(f))['workloads'][0] for f in sys.argv[1:3]); print(sys.argv[3],
      'plain %.3f ms, MTP %.3f ms (draft %.3f) = %.4fx' % (p['busy_ms_per_step'], m['busy_ms_per_step'],
      m['draft_ms_per_step'], m['busy_ms_per_step'] / p['busy_ms_per_step']))" \
      "$OUT/gemma_plain_$name.json" "$OUT/gemma_mtp_$name.json" "$name ($vars)" 2>/dev/null || echo "$name failed"
  done
fi
if has gemma; then
  echo "== (e) Gemma-4-shaped 9B dense target: plain vs frozen-KV MTP S=3 (dummy weights), 1 request"
  off gemma_plain 150 "${G[@]}"
  off gemma_mtp 150 "${G[@]}" "${MTPG[@]}"
fi
if has qwen; then
  echo "== (c) Qwen3-0.6B shape, nano-vllm recipe (256 requests, lengths U[100, 1024]) + HF generate"
  off qwen_nano 200 "${RECIPE[@]}" --hf --hf-output-len 64
  # and the 8B's fixed workloads on the same shape (1 and 64 requests, 512 in / 256 out)
  off qwen_small 150 "${LLAMA8B[@]}" --model-path $DM/qwen3-0.6b --warmup-rounds 1
fi
if has pair; then
  # A round takes ~0.1 s here: one warm-up round, then the median of 5 (same prompts, no prefix cache).
  echo "== (e) bundled pair, MTP on / off, 1 and 8 requests"
  P=benchmarks/prompts_shakespeare_heldout.txt
  MTP=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A --speculative-num-steps 3)
  for mode in plain mtp; do
    extra=(); [ $mode = mtp ] && extra=("${MTP[@]}")
    timeout 90 python3 benchmarks/offline.py --model-path $T --device cuda --prompts-file $P --output-len 128 \
      --num-prompts 1,8 --max-running-requests 8 --log-level warning --json "$OUT/pair_$mode.json" "${extra[@]}" \
      --warmup-rounds 1 --repeat 5 --disable-prefix-cache \
      > "$OUT/pair_$mode.log" 2>&1 || echo "pair_$mode failed"
  done
fi
if has depth; then
  # --overlap-depth A/B (DEPTHS, default "2 3") on the host-bound shapes: the bundled pair plain /
  # MTP at 1 and 8 requests (as the pair part), Qwen3-0.6B at 1 and 64 requests (as qwen_small).
  echo "== overlap depth ${DEPTHS:-2 3}: bundled pair plain / MTP (1, 8 requests), Qwen3-0.6B (1, 64)"
  P=benchmarks/prompts_shakespeare_heldout.txt
  MTP=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A --speculative-num-steps 3)
  for d in ${DEPTHS:-2 3}; do
    for mode in plain mtp; do
      extra=(); [ $mode = mtp ] && extra=("${MTP[@]}")
      timeout 90 python3 benchmarks/offline.py --model-path $T --device cuda --prompts-file $P --output-len 128 \
        --num-prompts 1,8 --max-running-requests 8 --log-level warning --json "$OUT/depth${d}_pair_$mode.json" \
        "${extra[@]}" --warmup-rounds 1 --repeat 5 --disable-prefix-cache --overlap-depth $d \
        > "$OUT/depth${d}_pair_$mode.log" 2>&1 || echo "depth${d}_pair_$mode failed"
    done
    off depth${d}_qwen 150 "${LLAMA8B[@]}" --model-path $DM/qwen3-0.6b --warmup-rounds 1 --overlap-depth $d
  done
  for f in "$OUT"/depth*_*.json; do
    python3 -c "import json,sys; [print(sys.argv[1].split('/')[-1][:-5], w['num_prompts'], 'req: tok/s %.1f' % w['output_tok_s'],
      'idle %.1f%%' % (100 * w['gpu_idle_frac']), 'busy ms/step %.3f' % w['busy_ms_per_step'])
      for w in json.load(open(sys.argv[1]))['workloads']]" "$f" 2>/dev/null
  done
fi
if has scale; then
  # The grid a checker runs: each dummy shape at 1, 64 and 256 requests (512 in / 256 out), no
  # speed flags at all (the engine sizes its own batch limit), one engine start per shape.
  SCALE_MODELS=${SCALE_MODELS:-llama-3.1-8b gemma4-dense-9b qwen3-0.6b}
  echo "== default flags: $SCALE_MODELS at 1 / 64 / 256 requests"
  for m in $SCALE_MODELS; do
    echo "   $m"
    off scale_$m 200 --model-path $DM/$m --num-prompts 1,64,256 --input-len 512 --output-len 256 --warmup-rounds 1
  done
fi
for stage in tests kernels; do
  if has fp8$stage; then FP8_STAGES=$stage OUT=$OUT DM=$DM bash benchmarks/fp8_suite.sh; fi
done
if has fp8; then FP8_STAGES=engines OUT=$OUT DM=$DM bash benchmarks/fp8_suite.sh; fi
if has attn; then
  echo "== (f) decode attention alone"
  timeout 200 python3 benchmarks/attention_bench.py --json "$OUT/attention.json" > "$OUT/attention.log" 2>&1 \
    || { echo "attention bench failed"; tail -5 "$OUT/attention.log"; }
fi
# FlashInfer's JIT cache, one tarball per built module (a call returns files of <= 16 MiB):
# unpack them all into .fi-cache/ and carry it next time, and no kernel compiles again.
if [ -d .fi-cache/.cache ]; then
  mkdir -p "$FINAL/fi-cache"
  (cd .fi-cache && find .cache -mindepth 5 -maxdepth 5 -type d -path '*cached_ops/*' | while read -r d; do
     tar czf "$FINAL/fi-cache/$(basename "$d").tgz" "$d"; done
   tar czf "$FINAL/fi-cache/rest.tgz" --exclude='*/cached_ops/*' .cache)
fi
grep -H "host ms/step" "$OUT"/*.log > "$OUT/host_timing.txt"  # every process, first 200 steps included
python3 benchmarks/gpu_report.py "$OUT" $DM
[ -e "$OUT/fp8_summary.txt" ] && cp "$OUT/fp8_summary.txt" "$FINAL/"
cp "$OUT/summary.txt" "$FINAL/"; tar czf "$FINAL/results.tgz" -C "$OUT" .
