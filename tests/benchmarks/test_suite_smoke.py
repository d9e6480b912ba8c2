"""CPU rehearsal of benchmarks/suite.py and benchmarks/report.py on the tiny workload.

One suite call (gpu, ours, ours_host, ds_zero2; each system in its own process) into a temporary directory,
then checks on the JSON records and on the rendered table and plots.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class body runs
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    cmd = [sys.executable, str(BENCH / "suite.py"), "--workload", "tiny", "--device", "cpu", "--systems", "gpu",
           "ours", "ours_host", "ds_zero2", "--steps", "2", "--warmup", "1", "--out", str(out),
           "--commit", "c0ffee", "--timeout", "120", "--profile", "--profile-steps", "2", "--profile-systems", "ours_host"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env, cwd=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = list(out.glob("suite_tiny_*.jsonl"))
    assert len(files) == 1, files
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    return out, files[0], records, proc.stdout


def test_records(suite_run):
    _, _, records, stdout = suite_run
    by = {r["system"]: r for r in records}
    assert [r["system"] for r in records] == ["gpu", "ours", "ours_host", "ds_zero2"]
    for name in ("gpu", "ours", "ours_host", "ds_zero2"):
        assert f"[suite] {name}" in stdout  # per-system wall time line for the lead's budget
    for r in records:
        assert r["schema"] == "hf_superoffload.suite/1"
        assert r["commit"] == "c0ffee"
        assert r["workload"] == "tiny" and r["tokens_per_step"] == 2 * 64
        assert r["hardware"]["cores"] >= 1 and r["hardware"]["ram_gb"] > 0
        assert "torch" in r["versions"] and r["versions"]["torch"]
        assert "suite.py" in r["suite_command"] and r["wall_s"] >= 0

    for name in ("gpu", "ours", "ours_host"):
        r = by[name]
        assert r["status"] == "ok", r.get("reason", "") + r.get("log_tail", "")
        assert "--worker" in r["command"] and name in r["command"]
        assert r["params_counted"] == r["params"]  # the FLOP count's parameter formula matches the model
        assert len(r["step_s_all"]) == 2 and len(r["losses"]) == 2
        assert r["step_s_median"] == pytest.approx(sorted(r["step_s_all"])[0] / 2 + sorted(r["step_s_all"])[1] / 2,
                                                   abs=2e-4)
        # step_s_median is rounded to 0.1 ms: on a fast machine (12 ms steps) that alone is 0.4%
        assert r["tokens_per_s"] == pytest.approx(128 / r["step_s_median"], rel=1e-3 + 5e-5 / r["step_s_median"])
        expect_mfu = r["flops_per_token"] * r["tokens_per_s"] / 989e12
        assert r["mfu"] == pytest.approx(expect_mfu, rel=1e-3, abs=1e-4)
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["peak_host_rss_gb"] > 0
    gpu_tok = by["gpu"]["tokens_per_s"]
    assert by["gpu"]["x_gpu"] == 1.0
    for name in ("ours", "ours_host"):
        r = by[name]
        assert r["x_gpu"] == pytest.approx(r["tokens_per_s"] / gpu_tok, abs=1e-3)
        tel = r["telemetry"]
        assert len(tel["per_step"]) == 2
        for key in ("cpu_adam_s", "gpu_wait_s", "overlap"):
            assert tel[key] >= 0
        assert all(s["verdict"] for s in tel["per_step"])
        plan = r["plan"]
        assert plan["host_numel"] + plan["device_numel"] == r["params"]
        assert "hf_superoffload plan" in plan["summary"]
        assert r["hyper"]["max_grad_norm"] == 1.0
    assert by["ours_host"]["plan"]["device_numel"] == 0
    assert by["ours_host"]["ours_config"]["gpu_resident_buckets"] == 0
    assert "telemetry" not in by["gpu"]

    ds = by["ds_zero2"]
    if importlib.util.find_spec("deepspeed") is None:
        assert ds["status"] == "absent" and "deepspeed" in ds["reason"]
    else:  # installed here, but it has no CPU mode
        assert ds["status"] == "absent" and "cuda" in ds["reason"]
    assert "tokens_per_s" not in ds and "x_gpu" not in ds


def test_report(suite_run):
    out, path, records, _ = suite_run
    report = _module("report")
    docs = out / "docs"
    text = report.render_suite([str(path)], docs)
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(lines) == 1 + 4  # header, four systems (the rule line starts with "|-")
    gpu_row = next(ln for ln in lines if ln.startswith("| GPU-only"))
    assert gpu_row.split("|")[4].strip() == "1.00"
    ours_row = next(ln for ln in lines if ln.startswith("| hf_superoffload, default plan"))
    ours = next(r for r in records if r["system"] == "ours")
    gpu = next(r for r in records if r["system"] == "gpu")
    assert ours_row.split("|")[4].strip() == f"{ours['tokens_per_s'] / gpu['tokens_per_s']:.2f}"
    assert "CPU Adam" in ours_row
    ds_row = next(ln for ln in lines if ln.startswith("| DeepSpeed ZeRO-2"))
    assert "absent" in ds_row and ds_row.split("|")[2].strip() == "-"
    assert "commit `c0ffee`" in text
    for png in ("benchmarks_suite_tiny.png", "benchmarks_ablation_tiny.png"):
        assert (docs / png).stat().st_size > 5000
        assert (docs / png).read_bytes()[:4] == b"\x89PNG"


def test_report_reference_when_gpu_only_ooms():
    """8b_big: GPU-only is OOM; the ratio falls back to GPU-only's best run of the same model."""
    report = _module("report")
    model = {"hidden_size": 8}
    common = {"schema": "hf_superoffload.suite/1", "model": model, "seq_len": 16, "params": 10, "warmup": 1,
              "steps": 1}
    fits = [{**common, "run_id": "a", "workload": "8b", "batch_size": 4, "system": "gpu", "status": "ok",
             "tokens_per_s": 100.0}]
    big = [
        {**common, "run_id": "b", "workload": "8b_big", "batch_size": 16, "system": "gpu", "status": "oom",
         "reason": "out of GPU memory during warmup step 1", "peak_gpu_gb": 139.1},
        {**common, "run_id": "b", "workload": "8b_big", "batch_size": 16, "system": "ours", "status": "ok",
         "tokens_per_s": 120.0, "step_s_median": 1.0, "mfu": 0.3, "model_tflops": 300.0},
    ]
    ref, note = report.reference(big, fits + big)
    assert ref == 100.0 and "batch 4" in note
    table = report.suite_table(big, fits + big)
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert "oom" in rows[1] and "139.1" in rows[1]
    assert rows[2].split("|")[4].strip() == "1.20"
    assert report.reference(big, big)[0] is None


def test_profile_timeline(suite_run):
    """--profile: the trace records the CPU worker's thread too, and the record carries the per-step timeline."""
    out, _, records, _ = suite_run
    by = {r["system"]: r for r in records}
    assert "profile" not in by["ours"]  # only the systems asked for
    prof = by["ours_host"]["profile"]
    assert (out / prof["trace"]).is_file() and (out / prof["summary"]).is_file()
    steps = prof["timeline"]["steps"]
    assert [s["step"] for s in steps] == ["ProfilerStep#0", "ProfilerStep#1"]
    for st in steps:
        assert st["main"]["flush"] > 0 and "validate" in st["main"]
        assert st["worker"]["busy_ms"] <= st["wall_ms"]
    # step 0's CPU pass runs after its step() returned and before step 1's forward got its weights: inside the trace
    # (which window holds which part depends on timing)
    for key in ("cpu_adam", "upload"):
        assert sum(st["worker"].get(key, 0.0) for st in steps) > 0, key


def test_workload_shapes():
    suite = _module("suite")
    wl = suite.WORKLOADS["3.6b"]
    assert abs(wl.params() / 1e9 - 3.607) < 1e-3  # anchor: N = 3.607B
    assert abs(suite.WORKLOADS["8b"].params() / 1e9 - 8.03) < 0.01  # anchor: N = 8.03B
    assert suite.WORKLOADS["8b_big"].batch_size * 2048 > suite.WORKLOADS["8b"].tokens
    # anchor 3.6B GPU-only: 15,871 tokens/s -> 360.2 model TFLOP/s, MFU 36.4%
    assert wl.flops_per_token() * 15871 / 1e12 == pytest.approx(360.2, rel=2e-3)


def _spec(suite, tmp_path):
    import dataclasses

    return {"workload": dataclasses.asdict(suite.WORKLOADS["tiny"]), "device": "cpu", "warmup": 1, "steps": 2,
            "profile": False, "profile_steps": 1, "out_dir": str(tmp_path), "run_id": "t", "ours_config": {}}


def test_worker_records_oom_and_failure(tmp_path, monkeypatch):
    """An out-of-memory step gives status oom with where it happened; any other error gives failed + traceback."""
    import torch

    suite = _module("suite")
    calls = []

    def oom_on_second_step(system, wl, dev, spec):
        def step():
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return torch.tensor(1.0)

        return torch.nn.Linear(2, 2), step, {}

    monkeypatch.setattr(suite, "_make_system", oom_on_second_step)
    rec = suite.run_worker("gpu", _spec(suite, tmp_path))
    assert rec["status"] == "oom"
    assert "in timed step 1" in rec["reason"] and "2.00 GiB" in rec["reason"]
    assert rec["step_s_all"] == [] and "tokens_per_s" not in rec

    def broken(system, wl, dev, spec):
        raise RuntimeError("CPUAdam JIT build failed: nvcc not found")

    monkeypatch.setattr(suite, "_make_system", broken)
    rec = suite.run_worker("ds_zero2", _spec(suite, tmp_path))
    assert rec["status"] == "failed" and "nvcc not found" in rec["reason"]
    assert "RuntimeError" in rec["traceback_tail"]


def test_driver_timeout_and_budget(tmp_path):
    """A worker past its timeout is killed and recorded; a spent budget skips the rest without spawning."""
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, str(BENCH / "suite.py"), "--workload", "tiny", "--device", "cpu", "--out", str(out),
           "--systems", "gpu", "ours", "--timeout-for", "gpu=0.5", "--budget", "2", "--min-left", "1.9"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gpu, ours = (json.loads(line) for line in out.read_text().splitlines())
    assert gpu["status"] == "timeout" and gpu["exit_code"] is None and gpu["wall_s"] < 15
    assert ours["status"] == "skipped" and "budget" in ours["reason"] and "command" not in ours


def test_worker_records_gc_pauses_per_step_and_freezes_for_gcfreeze(tmp_path, monkeypatch):
    """``gc_per_step``: a full collection inside a timed step is counted in that step only; ``_gcfreeze`` rows
    freeze the objects built before the timed loop."""
    import gc

    import torch

    suite = _module("suite")
    calls = []

    def collects_in_second_timed_step(system, wl, dev, spec):
        def step():
            calls.append(1)
            if len(calls) == 3:  # warm-up 1, then timed steps 1 and 2
                gc.collect()
            return torch.tensor(1.0)

        _, info = suite._ours_config(system, {}, [10, 20], dev)  # what the row's modifiers put in the record
        return torch.nn.Linear(2, 2), step, info

    monkeypatch.setattr(suite, "_make_system", collects_in_second_timed_step)
    callbacks = list(gc.callbacks)
    try:
        rec = suite.run_worker("ours_host_gcfreeze", _spec(suite, tmp_path))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.callbacks[:] = callbacks  # the interpreter reads this very list: the worker's clock leaves with the test
    assert rec["status"] == "ok", rec
    first, second = rec["gc_per_step"]
    assert second["gc_gen2"] >= 1 and second["gc_s"] >= 0
    assert first["gc_gen2"] == 0


def test_static_suffix_sets_the_schedule_for_the_worker_process(monkeypatch):
    suite = _module("suite")
    monkeypatch.delenv("HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the worker's environment change stays in this test
    _, info = suite._ours_config("ours_host_static", {}, [10, 20], "cpu")
    assert os.environ["HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE"] == "static"
    assert info["env:HF_SUPEROFFLOAD_CPU_ADAM_SCHEDULE"] == "static"


def test_report_keeps_every_process_of_a_repeated_system():
    """A run that lists ours_host twice keeps both records, numbered; a record appended twice stays one row."""
    report = _module("report")

    def rec(system, repeat, sec):
        return {"schema": "hf_superoffload.suite/1", "workload": "tiny", "run_id": "r1", "system": system,
                "repeat": repeat, "status": "ok", "step_s_median": sec, "tokens_per_s": 128 / sec, "params": 10,
                "batch_size": 2, "seq_len": 64, "warmup": 1, "steps": 2, "hardware": {}, "mfu": 0.1,
                "model_tflops": 1.0}

    records = [rec("gpu", 1, 1.0), rec("ours_host", 1, 1.25), rec("ours_host", 2, 1.20), rec("ours_host", 2, 1.20)]
    (rows,) = report.group_runs(records).values()
    assert [(r["system"], r["repeat"]) for r in rows] == [("gpu", 1), ("ours_host", 1), ("ours_host", 2)]
    table = report.suite_table(rows)
    label = report.SUITE_LABEL["ours_host"]
    assert f"| {label} #1 | 1.250 |" in table and f"| {label} #2 | 1.200 |" in table
    assert f"| {report.SUITE_LABEL['gpu']} | 1.000 |" in table  # not repeated: no number


def _row_settings(suite, system: str) -> dict:
    """What the row's name promises, from the suite's own tables (MODIFIERS) and its documented prefixes."""
    want = {}
    if system == "ours_host_nodefer":
        want["defer_moments"] = False
    if system.startswith("ours_host_lead"):
        want["d2h_lead_buckets"] = int(system.removeprefix("ours_host_lead"))
    base = system
    for suffix, setting in suite.MODIFIERS.items():
        if base.endswith(suffix):
            want.update({k: v for k, v in setting.items() if k not in ("env", "worker")})
            base = base.removesuffix(suffix)
    if base.startswith("ours_host_latep"):
        want.update(defer_master=True, defer_moments=True, d2h_lead_buckets=int(base.removeprefix("ours_host_latep")
                                                                                 or 4))
    return want


def test_every_ours_row_builds_its_config(monkeypatch):
    """Each row's SuperOffloadConfig is built without training; a planner switch lands in ``overrides``."""
    import dataclasses

    import torch

    from hf_superoffload import SuperOffloadConfig

    suite = _module("suite")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the _static row sets the worker's environment
    options = {f.name for f in dataclasses.fields(SuperOffloadConfig)}
    for system in suite.OURS:
        config, _ = suite._ours_config(system, {}, [10, 20], torch.device("cpu"))
        assert isinstance(config, SuperOffloadConfig), system
        for name, value in _row_settings(suite, system).items():
            where = config if name in options else config.overrides
            assert getattr(where, name) == value, (system, name)


def test_ours_config_json_takes_overrides_flat_or_nested():
    import torch

    suite = _module("suite")
    extra = {"bucket_size_mb": 8, "redo_window": 3, "overrides": {"max_redo_rate": 0.25}}
    config, _ = suite._ours_config("ours", extra, [10, 20], torch.device("cpu"))
    assert config.bucket_size_mb == 8
    assert config.overrides.redo_window == 3 and config.overrides.max_redo_rate == 0.25
    with pytest.raises(ValueError, match="valid keys"):
        suite._ours_config("ours", {"bucket_size": 8}, [10, 20], torch.device("cpu"))
