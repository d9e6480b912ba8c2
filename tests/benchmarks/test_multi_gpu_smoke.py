"""CPU rehearsal of benchmarks/multi_gpu.py: the rows of issue #32 on the tiny preset, gloo, two processes each.

One driver call runs a data-parallel row and a Ulysses row (each its own ``torchrun``); the records must carry what the GPU session reads: median/min/max over the timed steps, every rank's peak host memory
and plan, and the planner's predictions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_bench_multi_gpu", BENCH / "multi_gpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_parse_and_a_bad_row_is_refused() -> None:
    mg = _module()
    assert mg.parse_row("dp2_8b") == {"row": "dp2_8b", "nproc": 2, "model": "8b", "batch": 4, "seq": 2048, "sp": 1,
                                      "layers": None}
    assert mg.parse_row("8:13b:1:1m:8:20")["seq"] == 1024**2
    with pytest.raises(SystemExit, match="does not divide"):
        mg.parse_row("2:tiny:1:64:4")
    with pytest.raises(SystemExit, match="NPROC:MODEL"):
        mg.parse_row("dp3")


def test_data_parallel_and_ulysses_rows_on_two_cpu_processes(tmp_path: Path) -> None:
    out = tmp_path / "multi_gpu.jsonl"
    rows = ["2:tiny:2:64:1", "2:tiny:1:128:2"]
    cmd = [sys.executable, str(BENCH / "multi_gpu.py"), "--device", "cpu", "--rows", *rows, "--warmup", "1",
           "--steps", "2", "--timeout", "240", "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in recs] == rows
    dp, uly = recs
    assert dp["status"] == "ok" and uly["status"] == "ok", json.dumps(recs, indent=1)[:4000]
    assert (dp["dp"], dp["sp"], uly["dp"], uly["sp"]) == (2, 1, 1, 2)
    for r in (dp, uly):
        s = r["step_s"]
        assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"]
        assert r["tokens_per_step"] == r["batch"] * r["seq"] * r["dp"]
        assert [x["rank"] for x in r["per_rank"]] == [0, 1]
        assert all(x["peak_host_rss_gb"] > 0 and x["host_params"] + x["device_params"] > 0 for x in r["per_rank"])
        assert {"gpu_peak_gb", "host_rss_gb", "step_s"} <= set(r["predicted"])


def test_a_row_needing_more_gpus_is_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mg = _module()
    monkeypatch.setattr(mg, "_gpus", lambda: 1)
    args = argparse.Namespace(device="cuda", out=str(tmp_path / "x.jsonl"))
    rec = mg.run_row(mg.parse_row("dp2_8b"), args)
    assert rec["status"] == "skipped" and "needs 2 GPUs, 1 visible" in rec["error"]
