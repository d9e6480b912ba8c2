"""[Note: calibrating the rates]: a measured step restates the profile's GEMM and CPU Adam rates so that the roofline,
with the restated profile, predicts what was measured; what one step cannot tell is left alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hf_superoffload.config import SuperOffloadConfig
from hf_superoffload.plan_cli import arrival_numels, load_model_config, resolve_profile
from hf_superoffload.planning.calibration import (
    RATE_CLAMP,
    MeasuredStep,
    calibrate_from_passes,
    calibrate_rates,
)
from hf_superoffload.planning.memory_model import ModelShape, PlanLike
from hf_superoffload.planning.planner import Workload, make_plan
from hf_superoffload.planning.step_time import bucket_task_seconds, predict_step_time, verdict_pass_seconds

BATCH, SEQ = 4, 2048


def _plan(host_buckets: int | str = 0) -> tuple[Any, Any, Any]:
    """8B on the H200 profile with every state on the host (``0``) or as configured."""
    cfg = load_model_config("8b")
    profile = resolve_profile("h200", gpu_mem_gb=None, host_mem_gb=None)
    plan = make_plan(arrival_numels(cfg), element_size=2, config=SuperOffloadConfig(gpu_resident_buckets=host_buckets),
                     profile=profile)
    return ModelShape.from_config(cfg), plan, profile


def _predicted(shape: Any, plan: Any, profile: Any, clipped: bool) -> Any:
    t = predict_step_time(shape, PlanLike.from_plan(plan), profile, batch_size=BATCH, seq_len=SEQ, grad_ckpt=True,
                          clipping_every_step=clipped)
    assert t is not None
    return t


def _whole_pass(plan: Any, profile: Any) -> float:
    """What the engine measures of the roofline's whole host pass after a verdict (its Adam calls' seconds): the CPU
    Adam and the uploads' memory time beside it; the buckets' fixed cost lies outside the calls."""
    return sum(verdict_pass_seconds(PlanLike.from_plan(plan), profile))


def _calibrate(shape: Any, plan: Any, profile: Any, m: MeasuredStep) -> Any:
    cal = calibrate_rates(profile, plan=plan, workload=Workload(shape, BATCH, SEQ, True), measured=m)
    assert cal is not None
    return cal


@pytest.mark.parametrize("clipped", [False, True], ids=["committed", "clipped"])
def test_a_step_as_predicted_keeps_the_rates(clipped: bool) -> None:
    shape, plan, profile = _plan()
    t = _predicted(shape, plan, profile, clipped)
    # the engine times the Adam calls: the buckets' fixed cost, outside them, is not in what it measures
    cpu = _whole_pass(plan, profile) if clipped else t.cpu_s - bucket_task_seconds(PlanLike.from_plan(plan))
    m = MeasuredStep(iteration_s=t.step_s, wait_s=t.exposed_s, cpu_s=cpu, clipped=clipped, undid=False)
    cal = _calibrate(shape, plan, profile, m)
    assert cal.gemm_factor == pytest.approx(1.0, rel=1e-9) and cal.cpu_factor == pytest.approx(1.0, rel=1e-9)
    assert cal.profile.matmul_tflops == pytest.approx(profile.matmul_tflops)


@pytest.mark.parametrize("bandwidth", [None, 123.2], ids=["bandwidth_from_rate", "bandwidth_measured"])
@pytest.mark.parametrize("deferred", [False, True], ids=["full_pass", "deferred_moments"])
@pytest.mark.parametrize("gpu_slower,cpu_slower", [(1.25, 1.0), (1.0, 1.6), (0.9, 1.3)])
def test_the_restated_rates_predict_the_measured_step(gpu_slower: float, cpu_slower: float, deferred: bool,
                                                      bandwidth: float | None) -> None:
    """Clipping on every step: the roofline with the restated profile gives the measured GPU busy time and CPU pass
    (with deferred moment stores the verdict-known pass moves 20 of 28 B/param; the uploads' memory time beside it
    scales with the rate where the profile has no measured bandwidth, and stays where it has one)."""
    shape, plan, profile = _plan()
    profile = dataclasses.replace(profile, host_memory_gbps=bandwidth)
    plan = dataclasses.replace(plan, defer_moments=deferred)
    t = _predicted(shape, plan, profile, True)
    busy, cpu, wait = t.gpu_s * gpu_slower, _whole_pass(plan, profile) * cpu_slower, 0.3
    m = MeasuredStep(iteration_s=busy + wait + t.tail_s, wait_s=wait, cpu_s=cpu, clipped=True, undid=False)
    cal = _calibrate(shape, plan, profile, m)
    again = _predicted(shape, plan, cal.profile, True)
    assert again.gpu_s == pytest.approx(busy, rel=1e-9)
    assert _whole_pass(plan, cal.profile) == pytest.approx(cpu, rel=1e-9)


@pytest.mark.parametrize("step_clipped", [False, True], ids=["step_committed", "step_clipped"])
@pytest.mark.parametrize("pass_clipped", [False, True], ids=["pass_committed", "pass_clipped"])
def test_the_pass_is_priced_by_its_own_steps_verdict(step_clipped: bool, pass_clipped: bool) -> None:
    """The measured pass is the step before's: a pass after a clipped verdict is the whole pass, one after a committed
    verdict the speculative and remaining passes, whatever the measured step's own verdict."""
    shape, plan, profile = _plan()
    whole = _whole_pass(plan, profile)
    # committed: the speculative and remaining passes' Adam calls (the buckets' fixed cost lies outside them)
    committed = _predicted(shape, plan, profile, False).cpu_s - bucket_task_seconds(PlanLike.from_plan(plan))
    pass_s = whole if pass_clipped else committed
    assert pass_s != pytest.approx(whole if not pass_clipped else committed)
    t = _predicted(shape, plan, profile, step_clipped)
    m = MeasuredStep(iteration_s=t.step_s, wait_s=t.exposed_s, cpu_s=pass_s, clipped=step_clipped, undid=False,
                     pass_clipped=pass_clipped)
    assert _calibrate(shape, plan, profile, m).cpu_factor == pytest.approx(1.0, rel=1e-9)


def test_what_one_step_cannot_tell_is_left_alone() -> None:
    shape, plan, profile = _plan()
    t = _predicted(shape, plan, profile, False)
    undid = _calibrate(shape, plan, profile, MeasuredStep(t.step_s, 0.0, 2 * t.cpu_s, clipped=False, undid=True))
    assert undid.cpu_factor is None and undid.profile.cpu_adam_gparams == profile.cpu_adam_gparams
    assert any("undid" in n for n in undid.notes)
    waited = _calibrate(shape, plan, profile, MeasuredStep(1.0, 2.0, t.cpu_s, clipped=False, undid=False))
    assert waited.gemm_factor is None and waited.profile.matmul_tflops == profile.matmul_tflops
    shape, device_only, profile = _plan("auto")
    if device_only.host_numel == 0:
        none = _calibrate(shape, device_only, profile, MeasuredStep(1.0, 0.0, 0.0, clipped=False, undid=False))
        assert none.cpu_factor is None and any("no host buckets" in n for n in none.notes)


def test_a_profile_of_another_machine_is_corrected_at_most_by_the_clamp_and_said() -> None:
    shape, plan, profile = _plan()
    t = _predicted(shape, plan, profile, True)
    m = MeasuredStep(iteration_s=10 * t.gpu_s + t.tail_s, wait_s=0.0, cpu_s=100.0, clipped=True, undid=False)
    cal = _calibrate(shape, plan, profile, m)
    assert cal.gemm_factor == pytest.approx(1 / RATE_CLAMP) and cal.cpu_factor == pytest.approx(1 / RATE_CLAMP)
    assert sum("another machine" in n for n in cal.notes) == 2


def test_a_link_bound_micro_batch_leaves_the_gemm_rate() -> None:
    """Host accumulation under weight flow: the roofline binds each micro-batch by the link and host memory, so the
    measured busy time says nothing of the GEMMs."""
    shape, plan, profile = _plan()
    flow = dataclasses.replace(plan, weight_mode=type(plan.weight_mode)("flow"),
                               host_accumulation=type(plan.host_accumulation)("landing"))
    m = MeasuredStep(iteration_s=20.0, wait_s=1.0, cpu_s=0.0, clipped=True, undid=False, micro_batches=8)
    cal = _calibrate(shape, flow, profile, m)
    assert cal.gemm_factor is None and any("link or host memory" in n for n in cal.notes)


def test_measured_seconds_must_be_sane() -> None:
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        MeasuredStep(iteration_s=-1.0, wait_s=0.0, cpu_s=0.0, clipped=False, undid=False)


def test_the_buckets_fixed_cost_is_not_the_rates() -> None:
    """[Note: bucket size]: the worker's fixed cost per bucket lies outside the Adam calls the engine times (the H100
    box's all-host 3.6B row: Adam seconds per pass 0.57-0.60 at 32 MB and 0.56-0.62 at 128 MB, the pass's wall
    0.04-0.10 s longer than them at 32 MB, 0.01-0.03 s at 128 MB), so the same measured Adam seconds restate the
    same rate whatever the bucket count, clipped or committed."""
    from hf_superoffload.planning.step_time import verdict_pass_rate_factor

    shape, plan, profile = _plan()
    few = PlanLike.from_plan(plan)
    many = dataclasses.replace(few, host_buckets=few.host_buckets * 3)
    measured = 1.3 * _whole_pass(plan, profile)
    assert verdict_pass_rate_factor(few, profile, measured, floor_s=0.0) == pytest.approx(
        verdict_pass_rate_factor(many, profile, measured, floor_s=0.0), rel=1e-12)
    t = _predicted(shape, plan, profile, False)
    adam = 1.3 * (t.cpu_s - bucket_task_seconds(few))
    m = MeasuredStep(iteration_s=t.step_s, wait_s=t.exposed_s, cpu_s=adam, clipped=False, undid=False)
    assert _calibrate(shape, plan, profile, m).cpu_factor == pytest.approx(1 / 1.3, rel=1e-9)


@pytest.mark.parametrize("noisy", [0, 1], ids=["first_pass_noisy", "last_pass_noisy"])
def test_of_two_passes_the_faster_restates_the_cpu_rate(noisy: int) -> None:
    """A pass runs slower than the host can, never faster: of the two measured, the faster one counts, whichever it
    is and whatever the verdicts of their steps (a clipped pass is priced as one); one that undid work does not."""
    shape, plan, profile = _plan()
    t = _predicted(shape, plan, profile, True)
    steady = _whole_pass(plan, profile) / 0.8  # this host's Adam runs at 0.8x the profile's rate
    passes = [MeasuredStep(iteration_s=t.step_s, wait_s=t.exposed_s, cpu_s=steady, clipped=True, undid=False)] * 2
    passes[noisy] = dataclasses.replace(passes[noisy], cpu_s=1.2 * steady)  # another process took the cores
    workload = Workload(shape, BATCH, SEQ, True)
    alone = [_calibrate(shape, plan, profile, m).cpu_factor for m in passes]  # each pass by itself
    assert RATE_CLAMP**-1 < alone[noisy] < alone[1 - noisy] < 0.9
    cal = calibrate_from_passes(profile, plan=plan, workload=workload, candidates=passes)
    assert cal is not None and cal.cpu_factor == alone[1 - noisy]
    assert any("faster of 2 passes" in n for n in cal.notes), cal.notes
    # a pass that undid work tells nothing of the rate, however fast
    undone = dataclasses.replace(passes[1 - noisy], cpu_s=0.5 * steady, undid=True)
    cal = calibrate_from_passes(profile, plan=plan, workload=workload, candidates=[undone, passes[noisy]])
    assert cal is not None and cal.cpu_factor == alone[noisy]
