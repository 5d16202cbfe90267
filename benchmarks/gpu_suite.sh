#!/usr/bin/env bash
# Everything that needs the H200, in one device call. Logs and JSON land in $OUT; a summary
# table is printed last. Usage (device tool, carry [".whl"]): bash benchmarks/gpu_suite.sh
set -uo pipefail
OUT=${OUT:-/tmp/tandem-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T=models/tiny-shakespeare/target; A=models/tiny-shakespeare/assistant
P=benchmarks/prompts_shakespeare_heldout.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

echo "== ceiling: HBM copy bandwidth, weight-streaming floor"
python3 benchmarks/hbm_bandwidth.py --model-path $T --model-path $A | tee "$OUT/hbm.json"

echo "== GPU tests (HF parity on CUDA, overlap, MTP, real server)"
timeout 240 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"

echo "== bundled pair, offline throughput (concurrency 1 and 8, MTP off/on)"
run() {  # name, extra args...
  local name=$1; shift
  timeout 75 python3 benchmarks/offline.py --model-path $T --device cuda --prompts-file $P --output-len 128 \
    --log-level warning --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1 || echo "$name failed"
}
MTP=(--speculative-algorithm FROZEN-KV-MTP --speculative-draft-model-path $A --speculative-num-steps 3)
run c1_plain --num-prompts 8 --max-running-requests 1 --hf
run c1_mtp --num-prompts 8 --max-running-requests 1 "${MTP[@]}"
run c8_plain --num-prompts 32 --max-running-requests 8
run c8_mtp --num-prompts 32 --max-running-requests 8 "${MTP[@]}"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':10} {'tok/s':>9} {'accept':>7} {'draft ms':>9} {'fwd ms':>8} {'sched ms':>9} {'steps':>6}")
for name in ("c1_plain", "c1_mtp", "c8_plain", "c8_mtp"):
    path = os.path.join(out, name + ".json")
    if not os.path.exists(path):
        print(name, "missing"); continue
    r = json.load(open(path))
    e = r["engine"]
    print(f"{name:10} {e['output_tok_s']:9.1f} {e.get('accept_length', 1.0):7.2f} {e['draft_ms_per_step']:9.2f} "
          f"{e['forward_ms_per_step']:8.2f} {e['scheduler_ms_per_step']:9.2f} {e['steps']:6d}")
    if "hf_transformers" in r:
        print(f"{'hf c1':10} {r['hf_transformers']['output_tok_s']:9.1f}")
PY
