"""CPU rehearsal of benchmarks/bench_triton.py: the sweep, its summary and the table, through the interpreter.

Not a measurement (KiB buckets, wall-clock timing): it proves the one GPU run will not die in the sweep's
bookkeeping, the correctness checks it runs on every config, or the suggested-table code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_triton.py"


def test_bench_triton_cpu_rehearsal(tmp_path: Path) -> None:
    out = tmp_path / "triton.json"
    cmd = [sys.executable, "-P", str(BENCH), "--cpu-rehearsal", "--sweep", "--sizes-mb", "16", "64", "--layouts",
           "odd", "--reps", "1", "--sweep-reps", "1", "--budget-s", "300", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "suggested size table" in proc.stdout and "HEURISTIC" in proc.stdout
    data = json.loads(out.read_text())
    assert data["sweep_complete"]
    assert all(r["error"] is None for r in data["sweep"]), [r for r in data["sweep"] if r["error"]][:3]
    ops = {r["op"] for r in data["sweep"]}
    assert ops == {"scatter_f32_bf16", "scatter_f32_bf16_sr", "scatter_bf16", "flatten_stats_bf16",
                   "flatten_stats_f32_bf16"}  # fmt: skip
    assert {b["bucket_mb"] for b in data["best"]} == {16, 64}
    for fam, entries in data["suggested_heuristic"].items():
        assert entries[-1]["max_elements"] is None and len(entries) == 2, fam
    rows = data["rows"]
    assert {r["op"] for r in rows} >= ops | {"upcast", "adamw"}
    assert all(r["legacy_graph_gbps"] for r in rows if r["op"] in ops)
