"""[Note: the thread trial]: the policy alone. The trial count stays only when its fastest steady iteration beats the
planned count's, step and host pass both, and every iteration compared is alike."""

from __future__ import annotations

import pytest

from hf_superoffload.planning.thread_trial import (
    ATTEMPTS,
    MARGIN,
    SAMPLES,
    TRIAL_STEPS,
    IterationSample,
    ThreadTrial,
)


def sample(step_s: float, pass_s: float | None = 0.5, *, verdict: str = "commit", micro: int = 1,
           kind: tuple[bool, bool] | None = (False, False), threads: int | None = 15) -> IterationSample:
    return IterationSample(step_s, verdict, micro, pass_adam_s=pass_s, pass_kind=None if pass_s is None else kind,
                           pass_threads=None if pass_s is None else threads)


MIXED = sample(9.9, 9.9, verdict="redo", threads=15)
"""What the iterations the trial must not read look like: were one read, every comparison would change."""


def run(base: list[IterationSample], tried: list[IterationSample], after: int = 2
        ) -> tuple[list[int | None], ThreadTrial]:
    """The steps after a calibration after step 3, one iteration each: the move's (4), the baseline, the mixed one,
    the trial's, and ``after`` more; what ``after_step`` asks for after each."""
    assert len(base) == len(tried) == SAMPLES
    trial = ThreadTrial.after_calibration(3, planned=15)
    fed = [MIXED, *base, MIXED, *tried] + [MIXED] * after
    return [trial.after_step(4 + k, s) for k, s in enumerate(fed)], trial


def test_a_faster_step_and_pass_keep_the_trial_count() -> None:
    # a noisy baseline iteration (an allocator retry, say) does not decide: each arm's fastest is compared
    asked, trial = run([sample(1.35, 0.50), sample(1.062, 0.52)], [sample(1.032, 0.47, threads=16)] * 2)
    assert asked == [None, None, 16, None, None, 16, None, None]
    assert len(asked) == TRIAL_STEPS + 1  # the last step at the trial count is the TRIAL_STEPS-th after the move
    assert trial.chosen == 16 and "1.062 s at 15 threads, 1.032 s at 16" in trial.why
    assert trial.as_record()["baseline_s"] == [1.35, 1.062] and trial.as_record()["trial_s"] == [1.032, 1.032]


@pytest.mark.parametrize(("tried", "why"), [
    ([sample(1.20, 0.55, threads=16)] * 2, "slower: the H200 box's case"),
    ([sample(1.062 * (1 - MARGIN / 2), 0.40, threads=16)] * 2, "a tie: within the margin"),
    ([sample(1.00, 0.52, threads=16)] * 2, "the step gained but the pass did not: noise, not the threads"),
])
def test_otherwise_the_planned_count_comes_back(tried: list[IterationSample], why: str) -> None:
    asked, trial = run([sample(1.062, 0.50)] * 2, tried)
    assert asked == [None, None, 16, None, None, 15, None, None], why
    assert trial.chosen == 15 and trial.trials == 1, why


UNLIKE = [
    ([sample(1.00, 0.40, threads=16), sample(1.00, 0.40, verdict="redo", threads=16)], "unlike verdicts"),
    ([sample(1.00, 0.40, micro=2, threads=16)] * 2, "unlike micro-batches"),
    ([sample(1.00, 0.40, kind=(True, False), threads=16)] * 2, "unlike passes"),
    ([sample(1.00, 0.40, threads=16), sample(1.00, None)], "no whole pass ended (a skipped step before)"),
    ([sample(1.00, 0.40, threads=15), sample(1.00, 0.40, threads=16)], "a pass not at the trial count"),
]


@pytest.mark.parametrize(("tried", "why"), UNLIKE)
def test_iterations_that_compare_nothing_begin_the_trial_again(tried: list[IterationSample], why: str) -> None:
    asked, trial = run([sample(1.062, 0.50)] * 2, tried, after=0)
    assert asked[5] == 15 and trial.chosen is None and trial.trials == 1, why
    # steps 4-9 ran: the iteration of step 10 mixes both counts, the baseline begins with step 11's
    assert trial.baseline_step == 11 and not trial.baseline and not trial.tried
    again = [MIXED, sample(1.062, 0.50), sample(1.062, 0.50), MIXED, *[sample(1.0, 0.45, threads=16)] * 2]
    asked = [trial.after_step(10 + k, s) for k, s in enumerate(again)]
    assert asked == [None, None, 16, None, None, 16] and trial.chosen == 16 and trial.trials == 2, why


def test_after_the_last_attempt_the_planned_count_stays() -> None:
    trial = ThreadTrial.after_calibration(3, planned=15)
    step, asked = 4, []
    for _ in range(ATTEMPTS):
        for s in [MIXED, *[sample(1.062, 0.5)] * SAMPLES, MIXED, *UNLIKE[0][0]]:
            asked.append(trial.after_step(step, s))
            step += 1
        assert asked[-1] == 15
        step = trial.baseline_step - 1 if trial.chosen is None else step
    assert trial.chosen == 15 and trial.trials == ATTEMPTS and "differ" in trial.why
    assert trial.after_step(step + 1, sample(0.5, 0.1, threads=16)) is None  # settled: nothing more asked


def test_a_noisy_trial_iteration_does_not_decide_either() -> None:
    asked, trial = run([sample(1.062, 0.50)] * 2, [sample(1.4, 0.55, threads=16), sample(1.00, 0.40, threads=16)])
    assert asked[5] == 16 and trial.chosen == 16


def test_a_baseline_without_a_pass_compares_nothing() -> None:
    asked, trial = run([sample(1.062, None), sample(1.062, 0.5)], [sample(0.9, 0.3, threads=16)] * 2, after=0)
    assert asked[5] == 15 and trial.chosen is None and trial.trials == 1
