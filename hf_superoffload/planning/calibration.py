"""The profile's rates restated from a measured step: [Note: calibrating the rates].

[Note: calibrating the rates]
The plan made at the first batch prices its choices with the profile's rates: the GEMM rate of the GPU and the CPU
Adam rate of the host. On a GPU the optimizer reads them from this host's cached measurement or, failing that, from
the shipped profile of the same GPU model ([Note: known rates] in hardware.py), whose host may be another machine.
Once the first ``CALIBRATION_STEPS`` steps have run, the optimizer hands the faster of the last two (the one whose
GPU was busy the shorter time: a step runs slower than the GPU can, never faster) to :func:`calibrate_rates`,
which compares it with what the roofline (``step_time.py``) predicted (the same plan and workload, clipping as the
step's verdict says) and restates the two rates by the ratio of predicted to measured seconds:

* the GPU: the step's busy time, its wall time less the time the GPU sat idle waiting for host buckets ([Note: idle
  inside a wait] in runtime/telemetry.py) and the device tail's AdamW, against the predicted compute of its
  micro-batches. Only where the roofline says the
  micro-batches are compute-bound (with the link or host memory binding them, the ratio would say nothing of the
  GEMMs);
* the CPU: the worker's Adam seconds of one step's whole host pass (``StepStats.host_pass``: the passes of the
  two steps before the last, the last ones complete when the calibration runs; the faster counts, as a pass runs
  slower than the host can, never faster: one slow pass once clamped the rate on an H100 box) against the
  roofline's pass of that step: with clipping, the whole pass after the verdict (the rate restated so that its
  Adam share fills what the uploads beside it leave of the measured seconds: ``step_time.verdict_pass_seconds``,
  the roofline's own split); else the speculative and remaining passes. The host buckets' fixed cost (``step_time.BUCKET_TASK_S``
  each) lies outside the Adam calls the measurement times, so the roofline's side leaves it out. Only for a
  pass that undid nothing (an undo or redo adds passes the roofline's step does not have). Not the iteration's
  ``cpu_s``: that counts the passes that end between two ``step()`` calls, and a pass overlapping the next
  forward lands in either (measured on an H100 box at 8B: 0.05 s in the second iteration against 0.47 s of a
  steady pass, which clamped the rate to twice the truth), and not the first step's pass either (first-touch
  work made it 1.4-2.8x a steady one there): hence four steps before the calibration.

A ratio is clamped to ``[1 / RATE_CLAMP, RATE_CLAMP]``: one step is a noisy measurement, and a larger correction
means the profile describes another machine, which the log says. The restated profile is what the optimizer's
re-plan uses, and the record (``optimizer.calibration["timing"]``) keeps predicted and measured side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .hardware import HardwareProfile
from .memory_model import PlanLike
from .plan import OffloadPlan
from .planner import Workload
from .step_time import bucket_task_seconds, verdict_pass_rate_factor

__all__ = ["RATE_CLAMP", "MeasuredStep", "RateCalibration", "calibrate_from_passes", "calibrate_rates"]

RATE_CLAMP = 2.0
"""The largest factor by which one measured step restates a rate."""
# The roofline's micro-batch counts as compute-bound when its time is the GPU's within this share.
_COMPUTE_BOUND = 0.01


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One optimizer step as the engine measured it (``StepStats``)."""

    iteration_s: float
    """Wall seconds from the previous ``step()`` to this one: every micro-batch and the step."""
    wait_s: float
    """Seconds the GPU sat idle waiting for host buckets (``StepStats.gpu_idle_s``: [Note: idle inside a wait] in
    runtime/telemetry.py; not the training thread's waits, through which the GPU runs queued work)."""
    cpu_s: float
    """The worker's Adam seconds of one step's whole host pass (``PassRecord.adam_s``); 0: none was measured."""
    clipped: bool
    """Clipping fired (the verdict was a redo): the roofline's clipping case."""
    undid: bool
    """The pass ``cpu_s`` measures undid or redid speculative work."""
    micro_batches: int = 1
    pass_clipped: bool | None = None
    """Clipping fired in the step whose pass ``cpu_s`` measures (its whole pass ran after its verdict); ``None``:
    as ``clipped``."""

    def __post_init__(self) -> None:
        if min(self.iteration_s, self.wait_s, self.cpu_s) < 0 or self.micro_batches < 1:
            raise ValueError(f"{self}: seconds must be >= 0 and micro_batches >= 1")


@dataclass(frozen=True, slots=True)
class RateCalibration:
    """What :func:`calibrate_rates` compared and restated."""

    predicted_step_s: float
    measured_step_s: float
    gemm_factor: float | None
    """Factor applied to the profile's GEMM rate (``None``: not calibrated, with why in ``notes``)."""
    cpu_factor: float | None
    """Factor applied to the profile's CPU Adam rate (``None``: not calibrated)."""
    profile: HardwareProfile
    """The profile with the restated rates."""
    notes: tuple[str, ...] = ()

    def as_record(self) -> dict[str, object]:
        return {"predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
                "gemm_factor": self.gemm_factor, "cpu_factor": self.cpu_factor,
                "matmul_tflops": self.profile.matmul_tflops, "cpu_adam_gparams": self.profile.cpu_adam_gparams,
                "notes": list(self.notes)}


def _clamp(x: float) -> float:
    return min(RATE_CLAMP, max(1.0 / RATE_CLAMP, x))


def calibrate_rates(profile: HardwareProfile, *, plan: OffloadPlan, workload: Workload,
                    measured: MeasuredStep) -> RateCalibration | None:
    """[Note: calibrating the rates]: ``profile`` with its GEMM and CPU Adam rates restated from ``measured``, one
    step of ``plan`` on ``workload`` (its micro-batches as measured); ``None`` when the profile lacks the rates the
    roofline needs. One process."""
    like = PlanLike.from_plan(plan)
    t = workload.step_time(like, profile, clipping_every_step=measured.clipped,
                           micro_batches=measured.micro_batches)
    if t is None:
        return None
    notes: list[str] = []
    gemm: float | None = None
    busy = measured.iteration_s - measured.wait_s - t.tail_s
    compute_bound = t.micro_batches == 1 or t.micro_batch_s <= t.gpu_s * (1 + _COMPUTE_BOUND)
    if not compute_bound:
        notes.append("GEMM rate kept: the roofline binds the micro-batches by the link or host memory")
    elif busy <= 0:
        notes.append("GEMM rate kept: the step waited for the host longer than it ran")
    else:
        predicted_busy = (t.micro_batches - 1) * t.micro_batch_s + t.gpu_s
        gemm = _clamp(predicted_busy / busy)
    cpu: float | None = None
    if not plan.host_numel:
        notes.append("CPU Adam rate kept: no host buckets")
    elif measured.undid:
        notes.append("CPU Adam rate kept: the measured pass undid or redid speculative work")
    elif measured.cpu_s <= 0:
        notes.append("CPU Adam rate kept: no host pass had completed to measure")
    else:
        # the roofline's CPU seconds of the measured pass: with clipping, the whole host pass after the verdict (20
        # of 28 B/param with deferred moment stores), else the speculative and remaining passes of one step's buckets
        assert profile.cpu_adam_gparams is not None
        pass_clipped = measured.clipped if measured.pass_clipped is None else measured.pass_clipped
        floor = measured.cpu_s / RATE_CLAMP
        if pass_clipped:
            cpu = _clamp(verdict_pass_rate_factor(like, profile, measured.cpu_s, floor_s=floor))
        else:
            unclipped = t if not measured.clipped else workload.step_time(
                like, profile, micro_batches=measured.micro_batches)
            assert unclipped is not None  # the same profile priced t
            # the measured seconds are the Adam calls': the buckets' fixed cost, outside them, is no rate's
            cpu = _clamp((unclipped.cpu_s - bucket_task_seconds(like)) / measured.cpu_s)
    for name, f in (("GEMM", gemm), ("CPU Adam", cpu)):
        if f is not None and f in (RATE_CLAMP, 1.0 / RATE_CLAMP):
            notes.append(f"{name} rate off by more than {RATE_CLAMP:.0f}x: the profile describes another machine "
                         "(hf-superoffload plan --profile measure measures this one)")
    assert profile.matmul_tflops is not None and profile.cpu_adam_gparams is not None
    restated = dataclasses.replace(
        profile,
        matmul_tflops=profile.matmul_tflops * (gemm or 1.0),
        cpu_adam_gparams=profile.cpu_adam_gparams * (cpu or 1.0),
    )
    return RateCalibration(t.step_s, measured.iteration_s, gemm, cpu, restated, tuple(notes))


def calibrate_from_passes(profile: HardwareProfile, *, plan: OffloadPlan, workload: Workload,
                          candidates: Sequence[MeasuredStep]) -> RateCalibration | None:
    """:func:`calibrate_rates` of one step measured with each of several whole host passes (``candidates``: the
    same step, ``cpu_s``, ``undid`` and ``pass_clipped`` of each pass), keeping the one that restates the CPU Adam
    rate fastest: a pass runs slower than the host can, never faster (another process, page faults, a descheduled
    thread), so of two the faster is the nearer measurement ([Note: calibrating the rates])."""
    cals = [c for m in candidates if (c := calibrate_rates(profile, plan=plan, workload=workload, measured=m))]
    if not cals:
        return None
    rated = [c for c in cals if c.cpu_factor is not None]
    if not rated:
        return cals[0]
    best = max(rated, key=lambda c: c.cpu_factor or 0.0)
    if len(rated) > 1:
        others = ", ".join(f"x{c.cpu_factor:.2f}" for c in rated if c is not best)
        best = dataclasses.replace(best, notes=(*best.notes, f"CPU Adam rate from the faster of {len(rated)} "
                                                f"passes (the other: {others})"))
    return best
