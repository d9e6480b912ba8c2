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
    # two of the four families, one candidate per code path (the interpreter takes ~2.5 s per config and op:
    # every candidate of all four would take 10 minutes): kernels 1-3, statistics, stochastic rounding and the
    # dependent launch are all in them
    cmd = [sys.executable, "-P", str(BENCH), "--cpu-rehearsal", "--sweep", "--one-per-path", "--sizes-mb", "16",
           "64", "--layouts", "odd", "--reps", "1", "--sweep-reps", "1", "--budget-s", "600", "--families",
           "flatten_spread", "scatter_sr", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "suggested size table" in proc.stdout and "HEURISTIC" in proc.stdout
    data = json.loads(out.read_text())
    assert data["sweep_complete"]
    assert all(r["error"] is None for r in data["sweep"]), [r for r in data["sweep"] if r["error"]][:3]
    ops = {r["op"] for r in data["sweep"]}
    assert ops == {"scatter_f32_bf16_sr", "flatten_stats_bf16_spread", "flatten_stats_f32_bf16_spread"}
    assert {r["kernel"] for r in data["sweep"]} == {1, 2, 3} and any(r["pdl"] for r in data["sweep"])
    assert {b["bucket_mb"] for b in data["best"]} == {16, 64}
    for fam, entries in data["suggested_heuristic"].items():
        assert entries[-1]["max_elements"] is None and len({e["max_elements"] for e in entries}) == 2, fam
        assert entries[-1]["kernel"] != 3, fam  # the table must run every launch
    rows = data["rows"]
    assert {r["op"] for r in rows} >= ops | {"scatter_f32_bf16", "scatter_bf16", "flatten_stats_bf16", "upcast", "adamw"}
    assert all(r["legacy_graph_gbps"] for r in rows if r["op"] in ops)


def test_suggested_table_round_trips_kernel_2() -> None:
    """A sweep winner on kernel 2 (packed or not) survives the record -> table -> Python source trip."""
    from dataclasses import asdict

    from hf_superoffload.triton_kernels._configs import RowsConfig

    bench = _bench_module()
    cfgs = [RowsConfig(0, 4096, 4, 8, one_pass=False, kernel=2, packed=True), RowsConfig(0, 2048, 4, 8)]
    table = {"flatten": [{"max_elements": 1000, **asdict(cfgs[0]), "mean_frac": 0.9},
                         {"max_elements": None, **asdict(cfgs[1]), "mean_frac": 0.8}]}  # fmt: skip
    assert [bench.config_of(e) for e in table["flatten"]] == cfgs
    src = bench.heuristic_source(table)
    ns: dict[str, object] = {"RowsConfig": RowsConfig}
    exec(src.replace("HEURISTIC: dict[str, tuple[tuple[int | None, RowsConfig], ...]] =", "HEURISTIC ="), ns)
    assert ns["HEURISTIC"] == {"flatten": ((1000, cfgs[0]), (None, cfgs[1]))}
    assert "kernel=2, packed=True" in src and src.count("kernel=") == 1


def test_suggested_table_round_trips_fixed_cost_fields() -> None:
    """A winner with the fixed-cost or per-byte fields (wide epilogue, stream, min_per_program, interleave,
    realign, lookahead) survives the record -> table -> Python source trip; fields at their defaults are not
    printed."""
    from dataclasses import asdict

    from hf_superoffload.triton_kernels._configs import RowsConfig

    bench = _bench_module()
    cfgs = [
        RowsConfig(0, 2048, 4, 8, kernel=2, packed=True, epilogue="wide", stream=True, min_per_program=16384,
                   interleave=8192),
        RowsConfig(0, 1024, 4, 8, epilogue="wide"),
        RowsConfig(0, 2048, 4, 8, kernel=2, packed=True, realign=True, lookahead=True),
        RowsConfig(4096, 1024, 4, 0, one_pass=False),
    ]  # fmt: skip
    table = {"flatten": [{"max_elements": b, **asdict(c), "mean_frac": 0.9} for b, c in
                         zip((1000, 5000, 9000, None), cfgs)]}  # fmt: skip
    assert [bench.config_of(e) for e in table["flatten"]] == cfgs
    src = bench.heuristic_source(table)
    ns: dict[str, object] = {"RowsConfig": RowsConfig}
    exec(src.replace("HEURISTIC: dict[str, tuple[tuple[int | None, RowsConfig], ...]] =", "HEURISTIC ="), ns)
    assert ns["HEURISTIC"] == {"flatten": ((1000, cfgs[0]), (5000, cfgs[1]), (9000, cfgs[2]), (None, cfgs[3]))}
    assert src.count("epilogue=") == 2 and src.count("stream=") == 1 and src.count("interleave=") == 1
    assert src.count("realign=") == 1 and src.count("lookahead=") == 1


def _bench_module():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_triton", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_triton"] = bench  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop("bench_triton", None)
    return bench


def test_suggested_table_backs_kernel_3_with_another_config() -> None:
    """A kernel-3 winner (it runs only launches of a few aligned rows) gets the best other config of its size
    right after it, so the suggested table can run every launch (found by the rehearsal: a table whose last row
    was kernel 3 stopped the table part with an AssertionError); only kernel-3 records are a ValueError."""
    from dataclasses import asdict

    import pytest
    from hf_superoffload.triton_kernels import _configs

    bench = _bench_module()
    RowsConfig = _configs.RowsConfig
    k3 = RowsConfig(2048, 2048, 4, 0, kernel=3, packed=True)
    a, b = RowsConfig(4096, 1024, 4, 0, one_pass=False), RowsConfig(0, 2048, 4, 8, kernel=2, packed=True)
    gbps = {(16, k3): 90.0, (16, a): 80.0, (16, b): 70.0, (64, k3): 95.0, (64, a): 60.0, (64, b): 85.0}
    recs = [{"op": "scatter_f32_bf16", "family": "scatter", "bucket_mb": mb, "layout": "odd", "config": c.tag,
             "error": None, "graph_gbps": g, **asdict(c)} for (mb, c), g in gbps.items()]  # fmt: skip
    _, table = bench.summarize(recs, 100.0)
    got = [(e["max_elements"] is None, e["config"]) for e in table["scatter"]]
    assert got == [(False, k3.tag), (False, a.tag), (True, k3.tag), (True, b.tag)]
    saved = dict(_configs.HEURISTIC)
    try:
        bench.apply_table(table)
        assert _configs.choose("scatter", 1 << 40, kernel3=False) == b
        assert _configs.choose("scatter", 1, kernel3=False) == a and _configs.choose("scatter", 1) == k3
    finally:
        _configs.HEURISTIC.clear()
        _configs.HEURISTIC.update(saved)
    with pytest.raises(ValueError, match="kernel 1 or 2"):
        bench.summarize([r for r in recs if r["kernel"] == 3], 100.0)
