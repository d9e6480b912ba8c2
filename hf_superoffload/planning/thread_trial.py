"""Which CPU Adam thread count runs this host's steps fastest: [Note: the thread trial].

[Note: the thread trial]
The plan gives the CPU Adam every core of the process's affinity mask but one, which it leaves to the thread that
feeds the GPU. Whether that core is better spent on the Adam depends on the host, and no profile field predicts it:
on the H100 box all 16 cores ran the 3.6B all-host row 3% faster than 15, on the H200 box 10-22% slower
(docs/benchmarks.md). So the optimizer measures it once the calibration has settled the plan (one process, host
buckets, the thread count not set by the user, a core left to try):

* the baseline: the first iteration after the calibration's move, all of it at the planned count (the pass of the
  step before and the speculation of its own step);
* the trial count for the next two steps: the first of their iterations mixes both counts (the pass still
  running from the step before keeps the count it opened with: ``StepContext.threads``), the second is all at
  the trial count;
* the verdict: the trial count stays when the step *and* the host pass it times got faster, the step by at least
  ``MARGIN`` (one iteration each is a noisy measurement: a count that merely ties is not worth the core the GPU's
  thread could have), and the two iterations are alike (the same verdict, micro-batches and pass kind: a redo
  adds a whole pass); else the planned count comes back.

The CPU Adam is elementwise and its sums of squares are cut at fixed offsets whatever the thread count
([Note: fixed-order sums] in cpu_ext): the trial changes the speed, never the values.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MARGIN", "TRIAL_STEPS", "IterationSample", "ThreadTrial"]

MARGIN = 0.01
"""The share by which the trial count's step must be faster to stay."""
TRIAL_STEPS = 5
"""Steps after the calibration's until every iteration runs at the chosen count: the move's, the baseline, two at
the trial count, and the one whose iteration still holds the last trial pass (benchmarks warm up past them)."""


@dataclass(frozen=True, slots=True)
class IterationSample:
    """One iteration as the trial compares it (from ``StepStats`` and the optimizer's micro-batch count)."""

    iteration_s: float
    """Wall seconds from the previous ``step()`` to this one."""
    verdict: str
    micro_batches: int
    pass_adam_s: float | None
    """The worker's Adam seconds of the host pass that ended in this iteration (``PassRecord.adam_s``); ``None``:
    no whole pass ended (a skipped step before it)."""
    pass_kind: tuple[bool, bool] | None
    """That pass's ``(clipped, undid)``."""
    pass_threads: int | None

    def alike(self, other: IterationSample) -> bool:
        return (self.verdict, self.micro_batches, self.pass_kind) == (other.verdict, other.micro_batches,
                                                                      other.pass_kind)


@dataclass(slots=True)
class ThreadTrial:
    """[Note: the thread trial]: ``planned`` against ``trial`` threads; :meth:`after_step` says when to switch."""

    planned: int
    trial: int
    baseline_step: int
    """The step whose iteration is the baseline (the steps are counted from 1): the second after the calibration's
    (:meth:`after_calibration`)."""
    baseline: IterationSample | None = None
    tried: IterationSample | None = None
    chosen: int | None = None
    """The count the trial settled on (``None`` while it runs)."""
    why: str = ""

    @classmethod
    def after_calibration(cls, calibration_step: int, planned: int) -> ThreadTrial:
        """The trial of ``planned + 1`` threads once the calibration ran after step ``calibration_step``: the next
        step's iteration holds its move, the one after that is the baseline."""
        return cls(planned=planned, trial=planned + 1, baseline_step=calibration_step + 2)

    def after_step(self, step: int, sample: IterationSample) -> int | None:
        """Take step ``step``'s iteration; returns the thread count to run from the next step on, or ``None`` to
        leave it. The trial ends two steps after the baseline's (``chosen`` is set then)."""
        if self.chosen is not None or step < self.baseline_step:
            return None
        if step == self.baseline_step:
            self.baseline = sample
            return self.trial
        if step < self.baseline_step + 2:
            return None
        self.tried = sample
        self.chosen, self.why = self._verdict()
        return self.chosen

    def _verdict(self) -> tuple[int, str]:
        base, tried = self.baseline, self.tried
        assert base is not None and tried is not None
        if base.pass_adam_s is None or tried.pass_adam_s is None or tried.pass_threads != self.trial:
            return self.planned, "no whole host pass at each count to compare"
        if not base.alike(tried):
            return self.planned, "the two iterations differ (verdict, micro-batches or pass kind)"
        step_gain = 1.0 - tried.iteration_s / base.iteration_s if base.iteration_s > 0 else 0.0
        faster = step_gain >= MARGIN and tried.pass_adam_s < base.pass_adam_s
        return (self.trial if faster else self.planned), (
            f"step {base.iteration_s:.3f} s at {self.planned} threads, {tried.iteration_s:.3f} s at {self.trial}; "
            f"host pass {base.pass_adam_s:.3f} s and {tried.pass_adam_s:.3f} s")

    def as_record(self) -> dict[str, object]:
        return {"planned": self.planned, "trial": self.trial, "chosen": self.chosen, "why": self.why,
                "baseline_s": None if self.baseline is None else self.baseline.iteration_s,
                "trial_s": None if self.tried is None else self.tried.iteration_s}
