"""CPU rehearsal of benchmarks/bench_cpu_adam.py's schedule, bucket and contention options (numbers are not
checked: performance lives in the benchmark's output, not in tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu_adam.py"


def _module():
    spec = importlib.util.spec_from_file_location("_bench_cpu_adam", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_bucketed_rows_match_one_call_and_schedules_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _module()
    monkeypatch.setenv(bench.cpu_ext.SCHEDULE_ENV, "dynamic")
    whole, sliced = bench._alloc(5003), bench._alloc(5003)
    bench._impls(whole, 2)["ours_bf16"]()
    bench._impls(sliced, 2, bucket=1000)["ours_bf16"]()  # six calls, the last one 3 params
    assert all(torch.equal(a, b) for a, b in zip((whole.p, whole.m, whole.v, whole.out),
                                                (sliced.p, sliced.m, sliced.v, sliced.out), strict=True))

    results = bench.run(4099, [1, 2], repeats=1, warmup=0, schedules=("static", "dynamic"),
                        impls=("ours_bf16", "ours_bf16_only"), bucket=1024)
    assert [(r.impl, r.threads, r.schedule) for r in results] == [
        (impl, t, s) for s in ("static", "dynamic") for t in (1, 2) for impl in ("ours_bf16", "ours_bf16_only")]
    assert all(r.seconds is not None and r.seconds > 0 for r in results)
    assert os.environ[bench.cpu_ext.SCHEDULE_ENV] == "dynamic"
    assert "static" in bench._table(results)


def test_cli_with_contenders_writes_json_and_leaves_no_spinner(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(BENCH), "--numel", "20000", "--threads", "1", "--repeats", "1", "--warmup", "0",
           "--impls", "ours_bf16", "--schedules", "static", "dynamic", "--contend", "1", "--bucket-numel", "5000",
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    payload = json.loads(out.read_text())
    assert payload["contenders"] == 1 and payload["bucket_numel"] == 5000
    assert sorted(r["schedule"] for r in payload["results"]) == ["dynamic", "static"]
    assert not [pid for pid in _pids() if b"while True: pass" in _cmdline(pid)]


def _pids() -> list[str]:
    return [d for d in os.listdir("/proc") if d.isdigit()]


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""
