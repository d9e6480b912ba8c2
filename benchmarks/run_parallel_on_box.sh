#!/usr/bin/env bash
# One call on a multi-GPU box: data-parallel and sequence-parallel checks and timings. Results under $OUT.
#
#   bash benchmarks/run_parallel_on_box.sh            (PARTS="tests scaling ulysses" by default)
#
# Environment (optional): PARTS, MODEL (8b), DP_SEQ/DP_BATCH (2048/4 per GPU), SP_SEQ (256k), SP_WARMUP (1), ATTN (sdpa), SP_ARGS (more
# long_context.py options for the ulysses part, e.g. "--keep-attention"), STEPS/WARMUP,
# NGPU (default: all visible GPUs). Every part has its own timeout; one failing part does not stop the others.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/_stage.sh
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
MODEL=${MODEL:-8b}
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2; nvidia-smi topo -m 2>&1 | head -5
  python3 -c "import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__)"; } > "$OUT/hw.txt" 2>&1
# build the CPU Adam once, before several ranks race for it
python3 -P -c "from hf_superoffload import ops; print('cpu adam backend:', ops.backend())" 2>&1 | tail -1
run_lc() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout "$t" ${WRAP:-} python3 -m torch.distributed.run --standalone "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? ($(( $(date +%s) - T0 )) s)"; grep -h '"summary"' "$OUT/$name.log" | cut -c1-700
  grep -h '"step"' "$OUT/$name.log" | tail -1 | cut -c1-900
  cat "$OUT/$name.log" >> "$OUT/parallel_runs.log"
}
for part in ${PARTS:-tests scaling ulysses}; do
  case $part in
    tests)
      timeout ${TEST_TIMEOUT:-200} python3 -P -m pytest -p no:cacheprovider --import-mode=importlib -q -x \
        tests/distributed/test_data_parallel.py -k two_gpus > "$OUT/tests.txt" 2>&1
      echo "tests rc=$? ($(( $(date +%s) - T0 )) s)"; tail -3 "$OUT/tests.txt" ;;
    scaling)  # the same per-GPU batch on 1 GPU with the whole host, 1 GPU with 1/NGPU of its cores, and NGPU GPUs
      args="benchmarks/long_context.py --model $MODEL --seq-len ${DP_SEQ:-2048} --batch ${DP_BATCH:-4} --sp 1 --optimizer superoffload --steps ${STEPS:-3} --warmup ${WARMUP:-2} --out $OUT/parallel.jsonl"
      CUDA_VISIBLE_DEVICES=0 run_lc dp1_fullhost 200 --nproc_per_node 1 $args --tag "dp1 whole host"
      half=$(( $(nproc) / NGPU - 1 ))
      CUDA_VISIBLE_DEVICES=0 WRAP="taskset -c 0-$half" run_lc dp1_sharehost 200 --nproc_per_node 1 $args --tag "dp1 cores 0-$half"
      run_lc dpN 240 --nproc_per_node $NGPU $args --tag "dp$NGPU" ;;
    largest)  # the largest full-parameter model over all GPUs (data parallel, sp 1): LARGEST_LAYERS of the 14b family
      run_lc largest ${LARGEST_TIMEOUT:-240} --nproc_per_node $NGPU benchmarks/long_context.py --model 14b \
        --layers ${LARGEST_LAYERS:-96} --seq-len 2048 --batch ${LARGEST_BATCH:-4} --sp 1 --optimizer superoffload \
        --steps ${STEPS:-2} --warmup 1 --out "$OUT/parallel.jsonl" --tag "largest dp$NGPU" ;;
    side)  # single-GPU jobs side by side: the soak on GPU 0, the Triton kernel sweep on GPU 1
      CUDA_VISIBLE_DEVICES=0 timeout ${SOAK_TIMEOUT:-300} taskset -c 0-$(( $(nproc) / 2 - 1 )) python3 benchmarks/soak.py \
        --model 3.6b --steps ${SOAK_STEPS:-500} --batch 1 --device-memory-fraction 0.35 --out "$OUT/soak.json" \
        > "$OUT/soak.log" 2>&1 &
      TK=${TRITON_SRC:-.}  # a tree with triton_kernels/ and benchmarks/bench_triton.py (a branch under test)
      rm -rf /tmp/pkg_t; mkdir -p /tmp/pkg_t; cp -r "$STAGE/hf_superoffload" /tmp/pkg_t/
      rm -rf /tmp/pkg_t/hf_superoffload/triton_kernels; cp -r "$TK/triton_kernels" /tmp/pkg_t/hf_superoffload/triton_kernels
      CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/pkg_t timeout ${TRITON_TIMEOUT:-240} taskset -c $(( $(nproc) / 2 ))-$(( $(nproc) - 1 )) \
        python3 "$TK/benchmarks/bench_triton.py" --sweep --out "$OUT/triton.json" > "$OUT/triton.txt" 2>&1 &
      wait; echo "side done ($(( $(date +%s) - T0 )) s)"; tail -1 "$OUT/soak.log" | cut -c1-900; tail -25 "$OUT/triton.txt" ;;
    ulysses)
      run_lc ulysses 360 --nproc_per_node $NGPU benchmarks/long_context.py --model $MODEL --seq-len ${SP_SEQ:-256k} \
        --optimizer superoffload --attn ${ATTN:-sdpa} --steps 1 --warmup ${SP_WARMUP:-1} ${SP_ARGS:-} --out "$OUT/parallel.jsonl" \
        --tag "ulysses sp$NGPU ${ATTN:-sdpa} ${SP_ARGS:-}" ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
pack_out hw.txt parallel.jsonl
