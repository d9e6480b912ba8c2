"""Which CPU Adam thread count runs this host's steps fastest: [Note: the thread trial].

[Note: the thread trial]
The plan gives the CPU Adam every core of the process's affinity mask but one, which it leaves to the thread that
feeds the GPU. Whether that core is better spent on the Adam depends on the host, and no profile field predicts it:
on the H100 box all 16 cores ran the 3.6B all-host row 3% faster than 15, on the H200 box 10-22% slower
(docs/benchmarks.md). So the optimizer measures it once the calibration has settled the plan (host buckets, the
thread count not set by the user, a core left to try; under data parallel, of the rank's share of the host's
cores, and on every rank or none):

* the baseline: the first ``SAMPLES`` iterations after the calibration's move, all of each at the planned count
  (the pass of the step before and the speculation of its own step);
* the trial count from the next step on: the first of its iterations mixes both counts (the pass still running
  from the step before keeps the count it opened with: ``StepContext.threads``), the ``SAMPLES`` after it are all
  at the trial count;
* the verdict: the trial count stays when the step *and* the host pass got faster, each arm's fastest iteration
  against the other's (a step's noise is one-sided: on the H100 box one iteration of the 3.6B snippet row took
  1.35 s beside steps of 1.0 s, and with one iteration per count it decided that row's trial), the step by at least ``MARGIN`` (a count that merely
  ties is not worth the core the GPU's thread could have), and every iteration compared is alike (the same
  verdict, micro-batches and pass kind: a redo adds a whole pass); else the planned count comes back. Iterations
  that differ (clipping that stops firing turns redos into commits, a skipped step) compare nothing: the planned
  count comes back and the trial begins again, up to ``ATTEMPTS`` times (on the H100 box two of five rows changed
  verdict inside their first trial).

Under data parallel the ranks share each step (the collectives make every rank wait for the slowest), so each
step's sample is agreed before any rank's trial takes it: the slowest rank's iteration and host pass, no pass if
a rank lacks one, the trial count only where every rank's pass ran at it (one all-reduce on the optimizer's gloo
control group, from the training thread: the gatherer thread is all-gathering on the engine's group then). Every
rank's trial then reaches the same verdict at the same step. A rank that judged its own pass alone could keep the
planned count while another took one more: a step no faster for the rank that gave its core away. Data parallel
calibrates nothing, so its trial starts after step ``CALIBRATION_STEPS``, where the calibration would have run.

The CPU Adam is elementwise and its sums of squares are cut at fixed offsets whatever the thread count
([Note: fixed-order sums] in cpu_ext): the trial changes the speed, never the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ATTEMPTS", "MARGIN", "SAMPLES", "TRIAL_STEPS", "IterationSample", "ThreadTrial"]

MARGIN = 0.01
"""The share by which the trial count's step must be faster to stay."""
SAMPLES = 2
"""Steady iterations at each count."""
ATTEMPTS = 3
"""Trials before the planned count stays for want of iterations to compare."""
TRIAL_STEPS = 2 * SAMPLES + 3
"""Steps after the calibration's until every iteration runs at the chosen count when the first trial decides: the
move's, the baseline's, the mixed one, the trial's, and the one whose iteration still holds the last trial pass."""


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
    """The step whose iteration is the first of the baseline (the steps are counted from 1): the second after the
    calibration's (:meth:`after_calibration`)."""
    baseline: list[IterationSample] = field(default_factory=list)
    tried: list[IterationSample] = field(default_factory=list)
    chosen: int | None = None
    """The count the trial settled on (``None`` while it runs)."""
    why: str = ""
    trials: int = 0
    """Trials run to their verdict (all but the last had nothing to compare)."""

    @classmethod
    def after_calibration(cls, calibration_step: int, planned: int) -> ThreadTrial:
        """The trial of ``planned + 1`` threads once the calibration ran after step ``calibration_step``: the next
        step's iteration holds its move, the baseline begins with the one after that."""
        return cls(planned=planned, trial=planned + 1, baseline_step=calibration_step + 2)

    def after_step(self, step: int, sample: IterationSample) -> int | None:
        """Take step ``step``'s iteration; returns the thread count to run from the next step on, or ``None`` to
        leave it (``chosen`` is set with the verdict of a trial that compared, or of the last one)."""
        last_base = self.baseline_step + SAMPLES - 1
        first_trial = last_base + 2  # the iteration between holds a pass at each count
        if self.chosen is not None or step < self.baseline_step or last_base < step < first_trial:
            return None
        if step <= last_base:
            self.baseline.append(sample)
            return self.trial if step == last_base else None
        self.tried.append(sample)
        if len(self.tried) < SAMPLES:
            return None
        chosen, self.why = self._verdict()
        self.trials += 1
        if chosen is None and self.trials < ATTEMPTS:  # again from the iteration after the next (it mixes both)
            self.baseline_step, self.baseline, self.tried = step + 2, [], []
            return self.planned
        self.chosen = self.planned if chosen is None else chosen
        return self.chosen

    def _verdict(self) -> tuple[int | None, str]:
        both = self.baseline + self.tried
        if any(s.pass_adam_s is None for s in both) or any(s.pass_threads != self.trial for s in self.tried):
            return None, "no whole host pass at each count to compare"
        if not all(both[0].alike(s) for s in both[1:]):
            return None, "the iterations differ (verdict, micro-batches or pass kind)"
        base_s, tried_s = min(s.iteration_s for s in self.baseline), min(s.iteration_s for s in self.tried)
        base_pass = min(s.pass_adam_s for s in self.baseline)  # type: ignore[type-var]
        tried_pass = min(s.pass_adam_s for s in self.tried)  # type: ignore[type-var]
        step_gain = 1.0 - tried_s / base_s if base_s > 0 else 0.0
        faster = step_gain >= MARGIN and tried_pass < base_pass
        return (self.trial if faster else self.planned), (
            f"fastest step {base_s:.3f} s at {self.planned} threads, {tried_s:.3f} s at {self.trial}; host pass "
            f"{base_pass:.3f} s and {tried_pass:.3f} s")

    def as_record(self) -> dict[str, object]:
        return {"planned": self.planned, "trial": self.trial, "chosen": self.chosen, "why": self.why,
                "trials": self.trials,
                "baseline_s": [s.iteration_s for s in self.baseline], "trial_s": [s.iteration_s for s in self.tried]}
