"""benchmarks/triton_offline_sass.py: the row kernels compiled for sm_90 on this CPU-only machine (Triton's own
ptxas, no driver), checked for the properties kernel 2 was built for: no shared-memory exchange (barrier) in
any loop, four 16-byte loads in flight per thread at b4096 on 4 warps, registers for 12 programs per SM.
Kernel 1's misaligned-row loops have such barriers, which shows the check sees them.

In a subprocess: this pytest process may run Triton interpreted (tests/kernels), and Triton picks
interpreted or compiled once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_offline_sass.py"


def test_kernel2_loops_have_no_barriers_and_four_vectors_in_flight(tmp_path: Path) -> None:
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("this Triton ships no ptxas / cuobjdump")
    out = tmp_path / "sass.json"
    cmd = [sys.executable, "-P", str(SCRIPT), "--family", "flatten", "--tags", "--pairs", "bf16:bf16", "--stats",
           "--extra", "RowsConfig(0, 4096, 4, 8, kernel=2, packed=True)", "RowsConfig(0, 1024, 4, 8)",
           "--json", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    k2, k1 = json.loads(out.read_text())["records"]
    assert k2["config"] == "p8/b4096/w4/1p/k2w" and k1["config"] == "p8/b1024/w4/1p", proc.stdout
    assert k2["loops"] and not any(lp["bar"] for lp in k2["loops"]), k2
    assert max(lp["ldg16B"] for lp in k2["loops"] if lp["ldg2B"] == 0) >= 4, k2  # the innermost vector loop
    assert 0 < k2["regs"] <= 48 and k2["spill_ops"] == 0, k2  # 40 with Triton 3.6 and 3.9
    assert any(lp["bar"] for lp in k1["loops"]), k1
