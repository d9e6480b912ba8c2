#!/usr/bin/env bash
# One call on the GPU box: stage the package, check the CUDA path, time the anchor modes.
# Usage: bash benchmarks/gpu_session.sh [MODES...]   (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=/tmp/pkg; rm -rf $STAGE; mkdir -p $STAGE
cp -r hf_superoffload $STAGE/; cp -r triton_kernels $STAGE/hf_superoffload/triton_kernels; cp -r cpu_ext $STAGE/hf_superoffload/cpu_ext
export PYTHONPATH=$STAGE HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; lscpu | grep -E "Model name|Flags" | sed 's/Flags:/Flags:/' | cut -c1-2000
  python3 -c "import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__)"
} > "$OUT/hw.txt" 2>&1
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -P -m pytest -p no:cacheprovider --import-mode=importlib -q -x ${TEST_PATHS:-tests/runtime tests/unit} \
    > "$OUT/tests.txt" 2>&1; echo "tests rc=$?" >> "$OUT/tests.txt"; tail -5 "$OUT/tests.txt"
fi
for mode in ${MODES:-gpu ours ours_host}; do
  timeout ${MODE_TIMEOUT:-240} python3 benchmarks/anchor.py $mode >> "$OUT/anchor.jsonl" 2>> "$OUT/anchor_err.txt"
  echo "$mode rc=$?"; tail -1 "$OUT/anchor.jsonl" | cut -c1-600
done
