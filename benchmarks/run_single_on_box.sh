#!/usr/bin/env bash
# One call on a 1-GPU box: CUDA checks, weight flow under a 24 GiB cap, the soak, the largest model. Under $OUT.
#
#   PARTS="tests weightflow soak largest" bash benchmarks/run_single_on_box.sh
#
# Environment (optional): PARTS; WF_ACCUM (8), WF_BATCHES ("4,2"), WF_PROFILE=1 (one profiled step); SOAK_STEPS (500), SOAK_BATCH (1),
# SOAK_FRACTION (0.35); LARGEST_MODEL (14b), LARGEST_LAYERS (preset), LARGEST_BATCH (4), LARGEST_CLIP (1.0),
# LARGEST_ARGS (more long_context.py options, e.g. "--grad-accum 4 --accumulate-on-host"). A part may repeat:
# "largest:2" runs it again with LARGEST_ARGS2 as its extra options.
# Every part has its own timeout; one failing part does not stop the others.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/_stage.sh
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__)"; } > "$OUT/hw.txt" 2>&1
python3 -P -c "from hf_superoffload import ops; print('cpu adam backend:', ops.backend())" 2>&1 | tail -1
stamp() { echo "$1 rc=$2 ($(( $(date +%s) - T0 )) s)"; }
for part in ${PARTS:-tests weightflow soak largest}; do
  if [ "${part#largest:}" != "$part" ]; then n=${part#largest:}; v=LARGEST_ARGS$n; LARGEST_ARGS=${!v:-}; part=largest; fi
  case $part in
    tests)
      timeout ${TEST_TIMEOUT:-150} python3 -P -m pytest -p no:cacheprovider --import-mode=importlib -q \
        ${TEST_PATHS:-tests/runtime/test_host_accumulation.py tests/runtime/test_weight_flow.py} -k cuda > "$OUT/tests.txt" 2>&1
      stamp tests $?; tail -3 "$OUT/tests.txt" ;;
    weightflow)
      timeout ${WF_TIMEOUT:-200} python3 benchmarks/weight_flow_24g.py --grad-accum ${WF_ACCUM:-8} \
        --batch-sizes ${WF_BATCHES:-4,2} --steps ${WF_STEPS:-2} --warmup 1 --loss-chunk ${WF_CHUNK:-4096} --out "$OUT/weight_flow_24g.json" ${WF_PROFILE:+--profile-dir "$OUT/wf_trace"} \
        > "$OUT/weight_flow.log" 2>&1
      stamp weightflow $?; tail -c 1500 "$OUT/weight_flow_24g.json" 2>/dev/null || tail -5 "$OUT/weight_flow.log" ;;
    soak)
      timeout ${SOAK_TIMEOUT:-260} python3 benchmarks/soak.py --model 3.6b --steps ${SOAK_STEPS:-500} \
        --batch ${SOAK_BATCH:-1} --device-memory-fraction ${SOAK_FRACTION:-0.35} --out "$OUT/soak.json" \
        > "$OUT/soak.log" 2>&1
      stamp soak $?; tail -1 "$OUT/soak.log" | cut -c1-1500 ;;
    largest)
      timeout ${LARGEST_TIMEOUT:-240} python3 -m torch.distributed.run --standalone --nproc_per_node 1 \
        benchmarks/long_context.py --model ${LARGEST_MODEL:-14b} ${LARGEST_LAYERS:+--layers $LARGEST_LAYERS} \
        --seq-len 2048 --batch ${LARGEST_BATCH:-4} --sp 1 --max-grad-norm ${LARGEST_CLIP:-1.0} --steps ${LARGEST_STEPS:-3} \
        --warmup 1 ${LARGEST_ARGS:-} --out "$OUT/largest.jsonl" --tag "largest 1 GPU ${LARGEST_ARGS:-}" >> "$OUT/largest.log" 2>&1
      stamp largest $?; grep -h '"summary"' "$OUT/largest.log" | tail -1 | cut -c1-1200; grep -h '"step"' "$OUT/largest.log" | tail -1 | cut -c1-1200
      grep -h "Error\|error" "$OUT/largest.log" | tail -3 | cut -c1-400 ;;
  esac
done
free -g | head -2 >> "$OUT/hw.txt"
pack_out hw.txt tests.txt largest.jsonl weight_flow_24g.json soak.json
