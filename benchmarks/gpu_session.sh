#!/usr/bin/env bash
# One call on the GPU box: stage the package, check the CUDA path, time the anchor modes.
# Usage: bash benchmarks/gpu_session.sh [MODES...]   (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/_stage.sh
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; lscpu | grep -E "Model name|Flags" | sed 's/Flags:/Flags:/' | cut -c1-2000
  python3 -c "import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__)"
} > "$OUT/hw.txt" 2>&1
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -P -m pytest -p no:cacheprovider --import-mode=importlib -q -x ${TEST_PATHS:-tests/runtime tests/unit} \
    > "$OUT/tests.txt" 2>&1; echo "tests rc=$?" >> "$OUT/tests.txt"; tail -5 "$OUT/tests.txt"
fi
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 180 python3 -c "from hf_superoffload.planning.hardware import HardwareProfile as H; import json; print(json.dumps(H.measure('cuda', refresh=True).to_dict()))" \
    > "$OUT/profile.json" 2> "$OUT/profile_err.txt"; echo "profile rc=$?"; cut -c1-1200 "$OUT/profile.json"
fi
if [ "${BENCH_CPU:-0}" = 1 ]; then
  timeout 300 python3 benchmarks/bench_cpu_adam.py --numel ${CPU_NUMEL:-134217728} --threads 8 15 16 --repeats 5 \
    --out "$OUT/cpu_adam.json" > "$OUT/cpu_adam.txt" 2>&1; echo "cpu bench rc=$?"; tail -32 "$OUT/cpu_adam.txt"
fi
for mode in ${MODES:-gpu ours ours_host}; do
  timeout ${MODE_TIMEOUT:-240} python3 benchmarks/anchor.py $mode >> "$OUT/anchor.jsonl" 2>> "$OUT/anchor_err.txt"
  echo "$mode rc=$?"; tail -1 "$OUT/anchor.jsonl" | cut -c1-600
done
