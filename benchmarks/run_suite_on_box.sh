#!/usr/bin/env bash
# One call on the GPU box: stage the package, install DeepSpeed from the carried .whl/ (idempotent), run
# benchmarks/suite.py for each workload, render the tables. Everything lands under $OUT.
#
#   COMMIT=<sha> WORKLOADS="3.6b" SYSTEMS="gpu ours ours_host" BUDGET=540 bash benchmarks/run_suite_on_box.sh
#
# Environment (all optional):
#   COMMIT         git commit of the tree (the box has no .git)            default: unknown
#   WORKLOADS      suite workloads, run in order                            default: 3.6b
#   SYSTEMS        suite systems, in order                                  default: every system
#   BUDGET         total seconds for all workloads (keep < the 600 s limit of one call)   default: 540
#   TIMEOUT        seconds per system                                       default: 300
#   TIMEOUT_FOR    per-system overrides, e.g. "ds_superoffload=200 fsdp2_offload=150"
#   WARMUP, STEPS  default 2 and 3
#   SUITE_ARGS     extra suite.py arguments (e.g. "--profile", "--preset 14b", "--config-json plan.json")
#   DEVICE         cuda (default) or cpu (rehearsal on the dev machine with WORKLOADS=tiny)
#   DS_SITE        DeepSpeed --target dir                                   default: /tmp/site
#   RUN_TESTS=1    run a short CUDA test subset first (off by default: device time is scarce)
#   TEST_PATHS     default "tests/runtime"; "tests/runtime -m cuda" takes ~65 s, "tests/kernels -m cuda" ~140 s on a
#                  fresh box (Triton compiles every forced config: the cache is empty)
#   TEST_TIMEOUT   seconds for the tests                                    default: 120
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
source benchmarks/_stage.sh
DS_SITE=${DS_SITE:-/tmp/site}
# DeepSpeed's JIT build refuses an nvcc whose CUDA version differs from torch's; the CPU Adam op does not care
export DS_SKIP_CUDA_CHECK=${DS_SKIP_CUDA_CHECK:-1}
# DeepSpeed's CPUAdam is built just in time and needs a CUDA toolchain (CUDA_HOME with nvcc and headers)
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13 /opt/cuda; do [ -x "$d/bin/nvcc" ] && { export CUDA_HOME=$d; break; }; done
fi
if [ -d .whl ] && ! PYTHONPATH=$DS_SITE python3 -c "import deepspeed" > /dev/null 2>&1; then
  t=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target $DS_SITE \
    .whl/*.whl .whl/deepspeed-0.19.8.tar.gz > "$OUT/ds_install.txt" 2>&1
  echo "deepspeed install rc=$? in $(( $(date +%s) - t )) s (log: ds_install.txt)"; tail -3 "$OUT/ds_install.txt"
fi
export PYTHONPATH=$PYTHONPATH:$DS_SITE
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; lscpu | grep -E "Model name|Flags" | cut -c1-2000
  echo "CUDA_HOME=${CUDA_HOME:-unset} nvcc=$(command -v nvcc || echo none) ninja=$(command -v ninja || python3 -c 'import ninja; print(ninja.__file__)' 2>/dev/null || echo none)"
  python3 -c "import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__)"
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
} > "$OUT/hw.txt" 2>&1
grep -E "deepspeed|CUDA_HOME" "$OUT/hw.txt"
if [ "${RUN_TESTS:-0}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-120} python3 -P -m pytest -p no:cacheprovider --import-mode=importlib -q -x ${TEST_PATHS:-tests/runtime} \
    > "$OUT/tests.txt" 2>&1; echo "tests rc=$?" >> "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"
fi
BUDGET=${BUDGET:-540}
for wl in ${WORKLOADS:-3.6b}; do
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ $left -lt 30 ]; then echo "skip workload $wl: budget spent"; continue; fi
  timeout $(( left + 20 )) python3 benchmarks/suite.py --workload $wl --out "$OUT/results" --commit "${COMMIT:-unknown}" \
    --warmup ${WARMUP:-2} --steps ${STEPS:-3} --timeout ${TIMEOUT:-300} --budget $left \
    ${DEVICE:+--device $DEVICE} ${SYSTEMS:+--systems $SYSTEMS} ${TIMEOUT_FOR:+--timeout-for $TIMEOUT_FOR} ${SUITE_ARGS:-} --tag "box $(hostname)"
  echo "suite $wl rc=$?"
done
plots=--no-plots; python3 -c "import matplotlib" 2>/dev/null && plots=
python3 benchmarks/report.py --suite "$OUT"/results/suite_*.jsonl --docs "$OUT/docs" $plots > "$OUT/report.md" 2> "$OUT/report_err.txt" \
  || tail -5 "$OUT/report_err.txt"
echo "total $(( $(date +%s) - T0 )) s"
pack_out report.md hw.txt tests.txt
