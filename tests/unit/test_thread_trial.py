"""[Note: the thread trial]: the policy alone. The trial count stays only when a steady iteration at it is faster,
step and host pass both, than one at the planned count, and the two are alike."""

from __future__ import annotations

import pytest

from hf_superoffload.planning.thread_trial import MARGIN, IterationSample, ThreadTrial


def sample(step_s: float, pass_s: float | None = 0.5, *, verdict: str = "commit", micro: int = 1,
           kind: tuple[bool, bool] | None = (False, False), threads: int | None = 15) -> IterationSample:
    return IterationSample(step_s, verdict, micro, pass_adam_s=pass_s, pass_kind=None if pass_s is None else kind,
                           pass_threads=None if pass_s is None else threads)


def run(base: IterationSample, tried: IterationSample) -> tuple[list[int | None], ThreadTrial]:
    """Steps 4-8 of a trial whose baseline is step 5: what ``after_step`` asks for after each."""
    trial = ThreadTrial(planned=15, trial=16, baseline_step=5)
    mixed = sample(9.9, 9.9, verdict="redo", threads=15)  # the mixed iteration is never read
    asked = [trial.after_step(4, mixed), trial.after_step(5, base), trial.after_step(6, mixed),
             trial.after_step(7, tried), trial.after_step(8, mixed)]
    return asked, trial


def test_a_faster_step_and_pass_keep_the_trial_count() -> None:
    asked, trial = run(sample(1.062, 0.50), sample(1.032, 0.47, threads=16))
    assert asked == [None, 16, None, 16, None]
    assert trial.chosen == 16 and "1.062 s at 15 threads, 1.032 s at 16" in trial.why
    assert trial.as_record()["baseline_s"] == 1.062 and trial.as_record()["trial_s"] == 1.032


@pytest.mark.parametrize(("tried", "why"), [
    (sample(1.20, 0.55, threads=16), "slower"),  # the H200 box's case: more threads, slower step
    (sample(1.062 * (1 - MARGIN / 2), 0.40, threads=16), "a tie: within the margin"),
    (sample(1.00, 0.52, threads=16), "the step gained but the pass did not: noise, not the threads"),
    (sample(1.00, 0.40, verdict="redo", threads=16), "unlike verdicts"),
    (sample(1.00, 0.40, micro=2, threads=16), "unlike micro-batches"),
    (sample(1.00, 0.40, kind=(True, False), threads=16), "unlike passes"),
    (sample(1.00, None), "no whole pass ended (a skipped step before)"),
    (sample(1.00, 0.40, threads=15), "the pass did not run at the trial count"),
])
def test_otherwise_the_planned_count_comes_back(tried: IterationSample, why: str) -> None:
    asked, trial = run(sample(1.062, 0.50), tried)
    assert asked == [None, 16, None, 15, None], why
    assert trial.chosen == 15, why


def test_a_baseline_without_a_pass_restores_the_planned_count() -> None:
    asked, trial = run(sample(1.062, None), sample(0.9, 0.3, threads=16))
    assert asked[3] == 15 and trial.chosen == 15
