#!/usr/bin/env bash
# One call on the GPU box for issue #4: native Triton kernel tests, a config sweep and the size table.
# Results under $OUT (packed into one archive, beside the text summaries).
#
#   PARTS="tests sweep table" bash benchmarks/run_triton_on_box.sh
#
# Environment (optional): PARTS; TEST_K (pytest -k expression, default all CUDA kernel tests); SWEEP_FAMILIES
# ("flatten_spread scatter scatter_sr"), SWEEP_SIZES ("16"), SWEEP_BUDGET (120 s); TABLE_SIZES ("16 64 256").
# Every part has its own timeout; one failing part does not stop the others.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/_stage.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/hw.txt" 2>&1
stamp() { echo "$1 rc=$2 ($(( $(date +%s) - T0 )) s)"; }
for part in ${PARTS:-tests sweep table}; do
  case $part in
    tests)
      timeout ${TEST_TIMEOUT:-150} python3 -P -m pytest -p no:cacheprovider --import-mode=importlib -q tests/kernels \
        -m cuda ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.txt" 2>&1
      stamp tests $?; tail -3 "$OUT/tests.txt" ;;
    sweep)
      timeout $(( ${SWEEP_BUDGET:-120} + 90 )) python3 benchmarks/bench_triton.py --sweep --no-table \
        --families ${SWEEP_FAMILIES:-flatten_spread scatter scatter_sr} --sizes-mb ${SWEEP_SIZES:-16} \
        --budget-s ${SWEEP_BUDGET:-120} --out "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
      stamp sweep $?; tail -30 "$OUT/sweep.txt" ;;
    table)
      timeout ${TABLE_TIMEOUT:-200} python3 benchmarks/bench_triton.py --sizes-mb ${TABLE_SIZES:-16 64 256} \
        --out "$OUT/table.json" > "$OUT/table.txt" 2>&1
      stamp table $?; tail -40 "$OUT/table.txt" ;;
    *) echo "unknown part $part" ;;
  esac
done
pack_out hw.txt tests.txt sweep.txt table.txt
