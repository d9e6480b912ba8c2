"""benchmarks/defaults.py runs its systems end to end on the CPU (tiny shapes), so a GPU session never spends its
minutes on a broken script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hf_superoffload.planning.thread_trial import ATTEMPTS, TRIAL_STEPS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "defaults.py"


def test_snippet_and_trainer_rows_record_their_plans(tmp_path: Path) -> None:
    out = tmp_path / "d.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--rows", "tiny:2:2", "--systems", "snippet", "trainer",
                    "gpu_bf16_kept", "--device", "cpu", "--seq", "32", "--warmup", "1", "--steps", "2",
                    "--out", str(out)], check=True, timeout=600)
    recs = {r["system"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"snippet", "trainer", "gpu_bf16_kept"}
    baseline = recs.pop("gpu_bf16_kept")
    assert baseline["status"] == "ok" and baseline["kept_layers"] == baseline["layers"]  # the host holds them all
    for r in recs.values():
        assert r["status"] == "ok", r
        assert r["step_s"]["n"] == 2 and r["step_s"]["min"] <= r["step_s"]["median"] <= r["step_s"]["max"]
        assert r["plan"]["host_params"] + r["plan"]["device_params"] > 0
        assert r["last_step"]["verdict"] in ("commit", "redo", "skip")
    # every step of the snippet's loop and of the Trainer, the timed ones too, is in its per-step record, timed by
    # the same rule (past the warm-up and the optimizer's settling)
    for r in recs.values():
        assert len(r["per_step"]) == r["warmup_steps"] + 2 and r["warmup_steps"] >= 1
        # none timed before the step after the one that settled the optimizer (the thread trial runs its steps at
        # another thread count), unless it had not settled by the last warm-up step
        settled = [k for k, p in enumerate(r["per_step"]) if p["settled"]]
        assert r["settled_step"] == (settled[0] if settled else None)
        last_warmup = 1 + (ATTEMPTS - 1) * TRIAL_STEPS
        assert r["warmup_steps"] == (min(last_warmup, max(1, settled[0] + 2)) if settled else last_warmup), r
        assert all(p["iteration_s"] > 0 for p in r["per_step"][1:])
    # the prediction is for the schedule of the timed steps: clipped when most of them redid the step
    # (the Trainer's too: one verdict per optimizer step, the timed ones last)
    for r in recs.values():
        timed = [p["verdict"] for p in r["per_step"][-2:]]
        assert r["timed_redo_steps"] == timed.count("redo") and set(timed) <= {"commit", "redo", "skip"}


def test_named_settings_and_profile(tmp_path: Path) -> None:
    """``--set`` reaches the optimizer (and the record names it); ``--profile-dir`` leaves a trace and a breakdown."""
    out = tmp_path / "d.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--rows", "tiny:2", "--systems", "snippet", "--device", "cpu",
                    "--seq", "32", "--warmup", "1", "--steps", "2", "--set", "gpu_resident_buckets=0",
                    "d2h_lead_buckets=1", "--profile-dir", str(tmp_path / "traces"), "--clip", "1e9", "--out", str(out)],
                   check=True, timeout=600)
    (r,) = map(json.loads, out.read_text().splitlines())
    assert r["status"] == "ok", r
    assert r["settings"] == {"gpu_resident_buckets": 0, "d2h_lead_buckets": 1}
    assert r["clip"] == 1e9 and r["clipped_steps"] == 0  # ``--clip`` reaches the optimizer
    assert r["timed_redo_steps"] == 0
    assert r["plan"]["device_params"] == 0 and r["plan"]["d2h_lead"] == 1
    assert r["profile"]["steps"] == 1 and list((tmp_path / "traces").glob("*.json.gz"))


def test_an_out_of_memory_row_says_at_which_step_and_with_which_plan(monkeypatch) -> None:
    """A row that runs out of memory records the step, where, and the plan it had reached (the next call then
    knows what to look at): here the second step's forward raises it."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("defaults_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    defaults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(defaults)
    calls = {"n": 0}
    forward = torch.nn.Module.__call__

    def call(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        if type(self).__name__ == "LlamaForCausalLM":
            calls["n"] += 1
            if calls["n"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", call)
    rec = defaults.run_one("snippet", "tiny", 2, 1, None, 32, 1, 2, "cpu", None, None, None)
    assert rec["status"] == "oom" and rec["oom_step"] == 1 and rec["error"].startswith("CUDA out of memory")
    assert "plan_summary" in rec and rec["plan_summary"] == rec["plan_summary"].strip() != ""


def test_the_prediction_also_prices_the_plan_with_the_calibrated_rates() -> None:
    """A plan the calibration chose under this instance's restated rates is also priced with them, beside the
    shipped rates' figure: halving both rates makes that figure slower, and without a calibration it is absent."""
    import importlib.util

    import torch

    from hf_superoffload import SuperOffloadOptimizer

    spec = importlib.util.spec_from_file_location("defaults_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    defaults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(defaults)
    model = defaults._model("tiny", None, torch.device("cpu"), torch.bfloat16)
    opt = SuperOffloadOptimizer(model, lr=1e-4, max_grad_norm=1.0)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    shipped = defaults._predicted(opt, model, 2, 32, 1)
    assert shipped["step_s_calibrated_rates"] is None
    from hf_superoffload.planning.hardware import HardwareProfile

    rates = opt.profile if opt.profile.cpu_adam_gparams is not None else HardwareProfile.h200_pcie()
    opt.calibration = {"timing": {"matmul_tflops": rates.matmul_tflops / 2,
                                  "cpu_adam_gparams": rates.cpu_adam_gparams / 2}}
    cal = defaults._predicted(opt, model, 2, 32, 1)
    assert cal["step_s"] == shipped["step_s"]  # the shipped rates' figure does not move
    assert cal["step_s_calibrated_rates"] > shipped["step_s"]
    opt.close()
