"""[Note: calibrating the rates] in a run: after the first steps the optimizer compares the faster of the last two with
the roofline,
records both, logs the restated rates and prices later choices with them. On CPU the profile's rates are an H200's,
so the measured step is far slower: the correction is clamped and the log says the profile is another machine's."""

from __future__ import annotations

import logging
import sys
import time

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload import optimizer as optimizer_module
from hf_superoffload.planning import hardware
from hf_superoffload.planning.calibration import (
    RATE_CLAMP,
    MeasuredStep,
    calibrate_from_passes,
)
from hf_superoffload.planning.planner import CALIBRATION_STEPS
from hf_superoffload.runtime.telemetry import StepStats, Telemetry
from hf_superoffload.testing import pretend_profile, tiny_llama, train_steps

GiB = 1024**3
BATCH, SEQ = 2, 24


def _calibrating(monkeypatch: pytest.MonkeyPatch) -> tuple[hardware.HardwareProfile, torch.nn.Module,
                                                          SuperOffloadOptimizer]:
    """A tiny model whose every optimizer state is on the host, on a machine said to have an H200's rates.
    Speculation off, so a measured step undid nothing whatever the worker's timing."""
    profile = pretend_profile(64 * GiB, rates_of="h200_pcie")
    monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: profile))
    model = tiny_llama(seed=3, num_hidden_layers=2)
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False,
                                config=SuperOffloadConfig(gpu_resident_buckets=0, speculation=False))
    return profile, model, opt


@pytest.mark.parametrize("accum", [1, 2])
def test_the_first_steps_restate_the_rates_and_say_so(accum: int, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Speculation off, so the measured step undid nothing whatever the worker's timing (a speculative step undone
    by clipping leaves the CPU rate uncalibrated). One micro-batch per step: both rates are off by more than the clamp. Two: the recorded step counts both, and
    at H200 rates this tiny model's micro-batches are bound by host accumulation's link and adds, not the GEMMs,
    so the GEMM rate is kept."""
    profile, model, opt = _calibrating(monkeypatch)
    g = torch.Generator().manual_seed(11)
    data = [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range((CALIBRATION_STEPS + 1) * accum)]
    told: list[str] = []
    opt.calibration_listeners.append(told.append)
    seen: list[list[MeasuredStep]] = []  # what the optimizer hands the calibration

    def spy(*args: object, candidates: list[MeasuredStep], **kw: object) -> object:
        seen.append(list(candidates))
        return calibrate_from_passes(*args, candidates=candidates, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(optimizer_module, "calibrate_from_passes", spy)
    # the calibration takes the GPU's idle time inside the waits, not the waits ([Note: idle inside a wait]): on the
    # CPU the two are equal, so here the idle time is made half the wait to tell them apart
    take = Telemetry.take
    from hf_superoffload.runtime import host_pass

    adam = host_pass.ops.cpu_adamw_step_

    def slow_adam(*args: object, **kwargs: object) -> None:  # the next forward waits for the pass
        time.sleep(0.005)
        adam(*args, **kwargs)

    monkeypatch.setattr(host_pass.ops, "cpu_adamw_step_", slow_adam)

    def half_idle(self: Telemetry) -> StepStats:
        st = take(self)
        assert st.gpu_idle_s == st.wait_s  # on the CPU nothing runs ahead of the training thread
        st.gpu_idle_s = st.wait_s / 2
        return st

    monkeypatch.setattr(Telemetry, "take", half_idle)
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        steps = train_steps(model, opt, data, accumulation=accum)
    assert opt.calibration is not None
    timing = opt.calibration["timing"]
    last = steps[CALIBRATION_STEPS - 1].stats
    passed = last.host_pass  # the whole CPU pass of the step before it, which ended in its iteration
    assert timing["micro_batches"] == accum
    # of the last two steps the calibration measures the one whose GPU was busy the shortest
    pair = {CALIBRATION_STEPS - 1: steps[CALIBRATION_STEPS - 2].stats, CALIBRATION_STEPS: last}
    number, measured_step = min(pair.items(), key=lambda kv: kv[1].iteration_s - kv[1].gpu_idle_s)
    assert timing["step"] == number and timing["measured_step_s"] == measured_step.iteration_s
    # the next forward needs every upload of a step: its whole pass has ended, and was measured, by the next step()
    assert passed is not None and passed.adam_s > 0 and last.pass_s == passed.wall_s > 0
    before = steps[CALIBRATION_STEPS - 2].stats
    assert passed.clipped == (before.verdict == "redo") and passed.undid == (before.wasted_buckets > 0)
    # the same comparison, made here from the recorded steps with each of the last two passes, gives the recorded
    # factors: the faster pass's
    w = opt.workload
    assert w is not None
    two = [steps[CALIBRATION_STEPS - 2].stats.host_pass, passed]
    assert all(p is not None and p.adam_s > 0 for p in two)
    assert measured_step.wait_s > 0 and measured_step.gpu_idle_s == measured_step.wait_s / 2
    measured = [MeasuredStep(measured_step.iteration_s, measured_step.gpu_idle_s, p.adam_s,
                             clipped=measured_step.verdict == "redo", undid=p.undid,
                             micro_batches=accum, pass_clipped=p.clipped) for p in two if p is not None]
    expect = calibrate_from_passes(profile, plan=opt.plan, workload=w, candidates=measured)
    assert expect is not None
    assert len(seen) == 1 and seen[0] == measured  # both passes, the earlier first
    assert (timing["gemm_factor"], timing["cpu_factor"]) == (expect.gemm_factor, expect.cpu_factor)
    # the optimizer's profile stays the one it planned with; the restated rates are the record's
    assert opt.profile.cpu_adam_gparams == profile.cpu_adam_gparams != timing["cpu_adam_gparams"]
    # a CPU is far slower than an H200: clamped, and the log says the profile is another machine's
    said = [r.getMessage() for r in caplog.records if "predicted;" in r.getMessage()]
    assert len(said) == 1 and "another machine" in said[0], said
    assert timing["cpu_factor"] == pytest.approx(1 / RATE_CLAMP) and "CPU Adam rate x0.50" in said[0]
    assert len(told) == 1 and told[0].startswith(f"hf_superoffload calibration after {CALIBRATION_STEPS} steps: step ")
    assert "s measured" in told[0] and "CPU Adam rate x0.50" in told[0]
    if accum == 1:
        assert timing["gemm_factor"] == pytest.approx(1 / RATE_CLAMP), timing
        assert timing["matmul_tflops"] == pytest.approx(profile.matmul_tflops / RATE_CLAMP)
        assert "GEMM rate x0.50" in said[0]
    else:
        assert timing["gemm_factor"] is None and "GEMM rate kept" in said[0], timing
    opt.close()


def test_a_profile_without_rates_records_no_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: pretend_profile(64 * GiB)))
    model = tiny_llama(seed=3, num_hidden_layers=2)
    opt = SuperOffloadOptimizer(model, lr=1e-2, log_plan=False)
    g = torch.Generator().manual_seed(11)
    train_steps(model, opt, [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(CALIBRATION_STEPS + 1)])
    assert opt.calibration is None or "timing" not in opt.calibration
    opt.close()


def test_the_summary_says_what_was_measured_and_what_changed() -> None:
    from hf_superoffload.optimizer import calibration_summary

    record = {"measured_need_bytes": 130 * GiB, "predicted_required_bytes": 128 * GiB, "kept_layers": (21, 26),
              "device_buckets": (193, 193),
              "timing": {"measured_step_s": 0.936, "predicted_step_s": 0.888, "gemm_factor": 0.95, "cpu_factor": None}}
    assert calibration_summary(record, 2) == (
        "hf_superoffload calibration after 2 steps: peak 130.0 GiB reserved, 128.0 GiB predicted; kept layers 21 -> "
        "26; device buckets 193 -> 193; step 0.936 s measured, 0.888 s predicted (GEMM rate x0.95)")


def test_a_pass_is_timed_whole_its_speculative_share_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PassRecord.adam_s`` counts every Adam call of one step's host buckets, those made speculatively during
    the backward as well as those after the verdict: each call is made to last a known time, so a committed step's
    pass measures (calls per step) x that time, whichever iteration each call ran in. The deferred moment commits
    call the same kernel from the commit store: they are not the pass, and are not slowed."""
    from hf_superoffload.runtime import host_pass

    pause, calls = 0.01, []
    real = host_pass.ops.cpu_adamw_step_

    def slow_step(*args: object, **kwargs: object) -> None:
        if sys._getframe(1).f_code.co_name == "_cpu_step":  # the pass's Adam, not a commit's
            calls.append(1)
            time.sleep(pause)
        real(*args, **kwargs)

    monkeypatch.setattr(host_pass.ops, "cpu_adamw_step_", slow_step)
    model = tiny_llama(seed=3, num_hidden_layers=2)
    # no clipping: every step commits, each host run is stepped once per step (speculatively or after the verdict)
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=None, log_plan=False,
                                config=SuperOffloadConfig(gpu_resident_buckets=0, bucket_size_mb=0.05))
    g = torch.Generator().manual_seed(11)
    steps = train_steps(model, opt, [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(5)])
    opt.close()
    per_step = len(calls) // 5
    assert per_step > 1 and len(calls) == 5 * per_step
    assert sum(s.stats.speculated_buckets for s in steps[1:-1]) > 0, "no bucket was stepped before its verdict"
    for s in steps[1:]:
        st = s.stats
        assert st.verdict == "commit" and st.wasted_buckets == 0
        # every call of the pass at least `pause`; the kernel on this tiny model and the sleep's overshoot stay well
        # under 0.6 x `pause` a call (a call counted twice would give 2x)
        assert st.host_pass is not None and not st.host_pass.undid and not st.host_pass.clipped
        adam_s = st.host_pass.adam_s
        assert per_step * pause <= adam_s < 1.6 * per_step * pause, (adam_s, per_step)


@pytest.mark.parametrize("slow", [CALIBRATION_STEPS - 1, CALIBRATION_STEPS])
def test_of_the_last_two_steps_the_faster_is_measured(slow: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step runs slower than the GPU can, never faster: one of the two made slow (the training thread busy
    before its ``step()``), the calibration measures the other."""
    _, model, opt = _calibrating(monkeypatch)
    g = torch.Generator().manual_seed(11)
    iterations = {}
    for step in range(1, CALIBRATION_STEPS + 2):
        ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        if step == slow:
            time.sleep(0.3)
        opt.step()
        opt.zero_grad()
        iterations[step] = opt.last_step_stats.iteration_s
    timing = opt.calibration["timing"]
    fast = CALIBRATION_STEPS if slow == CALIBRATION_STEPS - 1 else CALIBRATION_STEPS - 1
    assert timing["step"] == fast and timing["measured_step_s"] == iterations[fast], (timing, iterations)
    opt.close()
