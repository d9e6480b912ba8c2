#!/usr/bin/env bash
# One call on the GPU box: what the defaults do (benchmarks/defaults.py), optionally after the CPU Adam tests on
# this host's SIMD (AVX-512 on the H200 box; the CI box has AVX2 only). Everything lands under $OUT.
#
#   ROWS="3.6b:8 8b:4" SYSTEMS="gpu_fp32 gpu_bf16 snippet host0" CPU_EXT_TESTS=1 bash benchmarks/run_defaults_on_box.sh
#
# WARMUP (default: defaults.py's, past the calibration and its move), STEPS, TIMEOUT, GPU_CAP_GIB, CLIP, and SET
# ("KEY=VALUE ...": settings of our systems, e.g. SET="bucket_size_mb=64 cpu_threads=12"; such a row is not the
# defaults and its record names them). PYTORCH_CUDA_ALLOC_CONF passes through to every row.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/_stage.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)";
  grep -o -E "avx512[a-z_0-9]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; free -g | head -2;
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } > "$OUT/hw.txt" 2>&1
if [ "${CPU_EXT_TESTS:-0}" = 1 ]; then
  t=$(date +%s)
  timeout "${CPU_EXT_TIMEOUT:-200}" python3 -P -m pytest tests/cpu_ext -q -p no:cacheprovider > "$OUT/cpu_ext_tests.txt" 2>&1
  echo "cpu_ext tests rc=$? in $(( $(date +%s) - t )) s: $(tail -1 "$OUT/cpu_ext_tests.txt")"
  python3 -c "from hf_superoffload import ops; print('CPU Adam backend:', ops.backend())" >> "$OUT/cpu_ext_tests.txt" 2>&1
  tail -1 "$OUT/cpu_ext_tests.txt"
fi
# shellcheck disable=SC2086
python3 benchmarks/defaults.py --rows ${ROWS:-3.6b:8 8b:4} --systems ${SYSTEMS:-gpu_fp32 gpu_bf16 snippet host0} \
  ${WARMUP:+--warmup "$WARMUP"} --steps "${STEPS:-5}" --timeout "${TIMEOUT:-240}" --out "$OUT/defaults.jsonl" \
  ${GPU_CAP_GIB:+--gpu-cap-gib "$GPU_CAP_GIB"} ${CLIP:+--clip "$CLIP"} ${SET:+--set $SET}
python3 - "$OUT/defaults.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    s = r.get("step_s") or {}
    p = r.get("plan") or {}
    pred = r.get("predicted") or {}
    print(f"{r['preset']:>5} bs{r['batch']} acc{r['accum']} {r['system']:>9} {r['status']:>6} "
          f"step {s.get('median', float('nan')):.3f} [{s.get('min', float('nan')):.3f}-{s.get('max', float('nan')):.3f}] "
          f"mfu {r.get('mfu') or float('nan'):.3f} gpu {r.get('peak_gpu_gb') or float('nan'):.1f}GB "
          f"rss {r.get('host_rss_gb') or float('nan'):.1f}GB host_params {p.get('host_params', '-')} kept {p.get('kept_layers', r.get('kept_layers', '-'))} "
          f"pred gpu {pred.get('gpu_peak_gb') or float('nan'):.1f} rss {pred.get('host_rss_gb') or float('nan'):.1f} "
          f"step {pred.get('step_s') or float('nan'):.3f} {r.get('error', '')[:120]} {r.get('tail', '')[-300:]}")
PY
