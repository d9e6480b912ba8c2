"""benchmarks/trace_summary.py: the per-step breakdown of a profiler trace, on a synthetic trace with known answers
and on a real CPU trace of the engine (every thread recorded)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_summary.py"


@pytest.fixture(scope="module")
def ts():
    spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(name, ts, dur, tid, cat="user_annotation", pid=1, **args):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if args:
        e["args"] = args
    return e


def _synthetic():
    main, worker, compute, h2d = 10, 11, 7, 20
    ev = [
        _x("ProfilerStep#0", 0, 1000, main),
        _x("superoffload::flush", 100, 50, main),
        _x("Optimizer.step#SuperOffloadOptimizer.step", 400, 60, main),
        _x("superoffload::validate", 400, 40, main),          # validate ends at 440
        _x("superoffload::wait_cpu", 500, 200, main),
        _x("superoffload::cpu_adam", 450, 150, worker),
        _x("superoffload::upload", 600, 30, worker),
        _x("superoffload::cpu_adam", 620, 100, worker),          # overlaps the upload: union 450..720
        _x("superoffload::upload", 720, 20, worker),             # last upload ends at 740
        # compute stream: busy 0-300, gap 300-420 (starts inside nothing: python), 420-460, gap 460-520
        # (validate ended at 440; Optimizer.step open until 460 -> ends at 460: not open), ...
        _x("gemm", 0, 300, compute, cat="kernel", pid=0),
        _x("gemm", 420, 40, compute, cat="kernel", pid=0),
        _x("gemm", 540, 100, compute, cat="kernel", pid=0),      # gap 460-540 starts at 460 -> python
        _x("gemm", 660, 300, compute, cat="kernel", pid=0),      # gap 640-660 starts inside wait_cpu
        _x("Memcpy HtoD (Pinned -> Device)", 600, 100, h2d, cat="gpu_memcpy", pid=0, bytes=5_000_000),
        _x("Memcpy DtoH (Device -> Pinned)", 100, 50, h2d + 1, cat="gpu_memcpy", pid=0, bytes=1_000_000),
    ]
    return ev


def test_synthetic_breakdown(ts):
    s = ts.summarize(_synthetic(), min_gap_us=10)
    assert s["main_thread"] == 10 and s["compute_stream"] == [0, 7]
    (st,) = s["steps"]
    assert st["wall_ms"] == 1.0
    assert st["main"] == {"flush": 0.05, "validate": 0.04, "wait_cpu": 0.2}
    w = st["worker"]
    assert w["cpu_adam"] == 0.25 and w["upload"] == 0.05
    assert w["busy_ms"] == 0.29  # 450..740
    assert w["pass_ms"] == 0.3  # validate end 440 -> last upload end 740
    assert w["pass_busy_ms"] == 0.29  # the worker was idle 440..450
    g = st["gpu"]
    assert g["compute_busy_ms"] == 0.74
    assert g["compute_idle_ms"] == {"python": 0.2, "wait_cpu": 0.02}
    assert g["compute_idle_total_ms"] == 0.22
    assert g["copies"]["HtoD"] == {"GB": 0.005, "ms": 0.1, "GB_per_s": 50.0}
    assert g["copies"]["DtoH"]["GB_per_s"] == 20.0
    text = ts.format_text(s)
    assert "wait_cpu 0.0" in text and "HtoD 0.005 GB" in text


def test_gpu_mirrors_of_annotations_are_not_steps(ts):
    """CUDA traces repeat every user annotation on the GPU timeline ("gpu_user_annotation")."""
    ev = [*_synthetic(), _x("ProfilerStep#0", 5, 990, 7, cat="gpu_user_annotation", pid=0),
          _x("superoffload::flush", 110, 40, 7, cat="gpu_user_annotation", pid=0)]
    s = ts.summarize(ev, min_gap_us=10)
    assert [x["step"] for x in s["steps"]] == ["ProfilerStep#0"] and s["main_thread"] == 10
    assert s["steps"][0]["main"]["flush"] == 0.05 and s["steps"][0]["worker"]["busy_ms"] == 0.29


def test_gap_inside_validate_and_min_gap(ts):
    ev = _synthetic()
    # a kernel ending at 410 leaves a gap 410-420 that starts inside validate (400-440)
    ev.append(_x("small", 380, 30, 7, cat="kernel", pid=0))
    s = ts.summarize(ev, min_gap_us=5)
    idle = s["steps"][0]["gpu"]["compute_idle_ms"]
    assert idle == {"python": 0.16, "wait_cpu": 0.02, "validate": 0.01}  # 410-420 is inside validate, not step
    s = ts.summarize(ev, min_gap_us=500)  # every gap is shorter
    assert s["steps"][0]["gpu"]["compute_idle_ms"] == {}


def test_steps_split_the_ranges(ts):
    ev = [_x("ProfilerStep#0", 0, 100, 1), _x("ProfilerStep#1", 100, 100, 1),
          _x("superoffload::flush", 50, 100, 1), _x("superoffload::cpu_adam", 90, 20, 2)]
    s = ts.summarize(ev)
    a, b = s["steps"]
    assert a["main"] == {"flush": 0.05} and b["main"] == {"flush": 0.05}
    assert a["worker"]["cpu_adam"] == 0.01 and b["worker"]["cpu_adam"] == 0.01
    assert "gpu" not in a


def test_real_cpu_trace_records_the_worker_thread(ts, tmp_path):
    """A profiled CPU run of the engine: the worker thread's ranges are in the trace (profile_all_threads)."""
    from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
    from hf_superoffload.testing import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1.0,
                                config=SuperOffloadConfig(gpu_resident_buckets=0, bucket_size_mb=0.01))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    experimental = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=experimental) as p:
        for i in range(2):
            with torch.profiler.record_function(f"ProfilerStep#{i}"):
                step()
                opt.synchronize()
    raw = tmp_path / "t.json"
    p.export_chrome_trace(str(raw))
    gz = tmp_path / "t.json.gz"
    with raw.open("rb") as a, gzip.open(gz, "wb") as b:
        b.write(a.read())
    s = ts.summarize(ts.load_events(gz))
    opt.close()
    assert [x["step"] for x in s["steps"]] == ["ProfilerStep#0", "ProfilerStep#1"]
    for st in s["steps"]:
        assert st["main"]["flush"] > 0 and "validate" in st["main"]
        assert st["worker"]["cpu_adam"] > 0 and st["worker"]["upload"] > 0, st
        assert st["worker"]["busy_ms"] <= st["wall_ms"]
    assert json.loads(json.dumps(s)) == s


def test_timeline_bins_and_pageable_copies(ts):
    ev = [*_synthetic(), _x("Memcpy DtoH (Device -> Pageable)", 800, 1, 21, cat="gpu_memcpy", pid=0, bytes=8)]
    s = ts.summarize(ev, min_gap_us=10)
    assert s["steps"][0]["gpu"]["pageable_copies"] == 1
    assert ts.summarize(_synthetic())["steps"][0]["gpu"]["pageable_copies"] == 0
    tl = ts.timeline(ev, bin_ms=0.25)  # 4 bins of 250 us over the 1000-us step
    cols, rows = tl["columns"], tl["rows"]
    assert cols[:3] == ["gpu", "dtoh", "htod"] and "main.wait_cpu" in cols and "cpu_adam" in cols
    assert len(rows) == 4
    gpu = [r[1 + cols.index("gpu")] for r in rows]
    assert gpu == [100, 36, 76, 84]  # kernels 0-300, 420-460, 540-640, 660-960 in bins of 250 us
    wait = [r[1 + cols.index("main.wait_cpu")] for r in rows]
    assert wait == [0, 0, 80, 0]  # wait_cpu 500-700
    assert "t_ms" in ts.format_timeline(tl)
    assert ts.main([str(_write(ev)), "--bins", "0.5"]) == 0


def _write(ev):
    import tempfile

    f = Path(tempfile.mkdtemp()) / "t.json"
    f.write_text(json.dumps({"traceEvents": ev}))
    return f
