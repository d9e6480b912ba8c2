#!/usr/bin/env bash
# One call on a multi-GPU box: the several-GPU rows of issue #32 (benchmarks/multi_gpu.py: one torchrun process group
# per row, median/min/max over the timed steps, per-rank peak GPU and host memory, the planner's predictions beside).
# Everything lands under $OUT. A row needing more GPUs than the box has is recorded as skipped.
#
#   ROWS="dp1_8b dp2_8b" bash benchmarks/run_multi_gpu_on_box.sh                          # nvidia-h200-x2, ~5 min
#   ROWS=ulysses2_8b_256k bash benchmarks/run_multi_gpu_on_box.sh                          # nvidia-h200-x2, ~11 min
#   ROWS=sp2_13b_64k bash benchmarks/run_multi_gpu_on_box.sh                               # the 8-GPU rows rehearsed
#   ROWS="sp8_13b_1m" WARMUP=1 STEPS=1 bash benchmarks/run_multi_gpu_on_box.sh             # nvidia-h200-x8
#
# Environment (optional): ROWS (row names or NPROC:MODEL:BATCH:SEQ:SP[:LAYERS] specs, see multi_gpu.py), WARMUP (2),
# STEPS (5), WORKLOAD (none: the README snippet as written; hint: the step's shape passed), ROW_TIMEOUT (seconds per
# row, 560: one device call runs at most 600 s).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/_stage.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m 2>&1 | head -5
  lscpu | grep -E "Model name|^CPU\(s\)"; free -g | head -2
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %H %cd' 2>/dev/null; date -u; } > "$OUT/hw.txt" 2>&1
# build the CPU Adam once, before several ranks race for it
python3 -P -c "from hf_superoffload import ops; print('CPU Adam backend:', ops.backend())" 2>&1 | tail -1
# shellcheck disable=SC2086
python3 -P benchmarks/multi_gpu.py --rows ${ROWS:-dp1_8b dp2_8b} --warmup "${WARMUP:-2}" --steps "${STEPS:-5}" \
  --workload "${WORKLOAD:-none}" --timeout "${ROW_TIMEOUT:-560}" --out "$OUT/multi_gpu.jsonl"
python3 - "$OUT/multi_gpu.jsonl" <<'PY'
import json, sys
nan = float("nan")
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    s, p = r.get("step_s") or {}, r.get("predicted") or {}
    ranks = r.get("per_rank") or []
    gpu = " ".join(f"{x['peak_gpu_gb'] or nan:.1f}" for x in ranks)
    rss = " ".join(f"{x['peak_host_rss_gb']:.1f}" for x in ranks)
    print(f"{r['row']:>18} {r['status']:>7} dp{r.get('dp', '-')} sp{r['sp']} bs{r['batch']} seq{r['seq']} "
          f"step {s.get('median', nan):.3f} [{s.get('min', nan):.3f}-{s.get('max', nan):.3f}] n{s.get('n', 0)} "
          f"tok/s {r.get('tokens_per_s') or nan:.0f} mfu {r.get('mfu') or nan:.3f} | gpu GB/rank {gpu} "
          f"(pred {p.get('gpu_peak_gb') or nan:.1f}) | rss GB/rank {rss} (pred {p.get('host_rss_gb') or nan:.1f}) | "
          f"pred step {p.get('step_s') or nan:.3f} | {r.get('error', '')} {r.get('tail', '')[-400:]}")
base = {r["model"]: r for r in rows if r["status"] == "ok" and r["nproc"] == 1 and r["sp"] == 1}
for r in rows:
    b = base.get(r["model"])
    if b is not None and r is not b and r["status"] == "ok" and r["sp"] == 1 and r["batch"] == b["batch"]:
        print(f"{r['row']}: {r['tokens_per_s'] / b['tokens_per_s']:.2f}x the 1-GPU row {b['row']} (target >= 1.9x on 2)")
PY
echo "total $(( $(date +%s) - T0 )) s"
pack_out hw.txt multi_gpu.jsonl
