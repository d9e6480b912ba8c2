"""The adaptive deferral rule ([Note: adaptive master deferral], [Note: adaptive moment deferral]): a pure function of
what was measured."""

from __future__ import annotations

import pytest

from hf_superoffload.planning.planner import share_count
from hf_superoffload.runtime.master_deferral import (
    COMMIT_BYTES,
    MASTER_EXTRA_BYTES,
    MOMENTS_KEPT,
    DeferralObservation,
    DeferralSplit,
    next_split,
)

NUMELS = [100, 300, 50, 200, 100]


def obs(pending: float = 0.0, slack: float = 0.0, rate: float = 1e-3) -> DeferralObservation:
    return DeferralObservation(pending_bytes=pending, slack_s=slack, rate_s_per_byte=rate)


N = len(NUMELS)


def split(moments: int, masters: int = 0) -> DeferralSplit:
    return DeferralSplit(moments, masters)


def test_pending_work_removes_enough_masters_to_cover_it():
    # 8 B/param extra per deferred master: 1600 B pending = 200 params to give back
    assert next_split(NUMELS, split(N, 4), obs(pending=200 * MASTER_EXTRA_BYTES)) == split(N, 3)  # the 4th holds 200
    assert next_split(NUMELS, split(N, 4), obs(pending=201 * MASTER_EXTRA_BYTES)) == split(N, 2)  # 50 params more
    assert next_split(NUMELS, split(N, 4), obs(pending=1.0)) == split(N, 3)  # any pending work: at least one


def test_below_no_master_pending_work_gives_back_the_last_buckets_moments():
    """[Note: adaptive moment deferral]: 18 B/param a bucket's moments, the last bucket's first."""
    last = NUMELS[-1] * COMMIT_BYTES[False]
    assert next_split(NUMELS, split(N), obs(pending=last)) == split(N - 1)
    assert next_split(NUMELS, split(N), obs(pending=last + 1)) == split(N - 2)
    # masters first, then moments, along one line
    assert next_split(NUMELS, split(N, 1), obs(pending=NUMELS[0] * MASTER_EXTRA_BYTES + 1)) == split(N - 1)
    # never the first bucket's moments: its commits keep the slack measured
    assert MOMENTS_KEPT == 1
    assert next_split(NUMELS, split(N, 2), obs(pending=1e12)) == split(1)
    assert next_split(NUMELS, split(1), obs(pending=1e12, slack=5.0)) == split(1)
    assert next_split(NUMELS, split(0), obs(pending=1e12)) == split(0)  # a split below it is left there
    assert next_split([], split(0), obs(pending=1e12)) == split(0)


def test_slack_adds_only_whole_slots_that_fit_half_of_it_moments_before_masters():
    # rate 1e-3 s/B, gain 0.5: slack 1.6 s = 0.8 s of room = 800 B = 100 params of extra master work
    assert next_split(NUMELS, split(N), obs(slack=1.6)) == split(N, 1)  # the first bucket (100) fits exactly
    assert next_split(NUMELS, split(N, 1), obs(slack=1.6)) == split(N, 1)  # the next (300) does not: no oscillation
    assert next_split(NUMELS, split(0), obs(slack=1e9)) == split(N, N)  # never beyond all
    assert next_split(NUMELS, split(N), obs(slack=1.6, rate=0.0)) == split(N)  # no measured rate: no guess
    assert next_split(NUMELS, split(N, 3), obs()) == split(N, 3)  # nothing measured: unchanged
    # below: the next bucket's moments (18 B/param) come back before any master
    room = NUMELS[3] * COMMIT_BYTES[False] * 1e-3 * 2  # exactly the 4th bucket's moments
    assert next_split(NUMELS, split(3), obs(slack=room)) == split(4)
    assert next_split(NUMELS, split(3), obs(slack=room * 0.99)) == split(3)
    both = (NUMELS[4] * COMMIT_BYTES[False] + NUMELS[0] * MASTER_EXTRA_BYTES) * 1e-3 * 2
    assert next_split(NUMELS, split(4), obs(slack=both)) == split(N, 1)


@pytest.mark.parametrize("bad", [split(N + 1), split(3, 1), split(2, 3), split(-1)])
def test_a_split_outside_the_buckets_order_is_a_bug(bad: DeferralSplit):
    with pytest.raises(ValueError, match="outside"):
        next_split(NUMELS, bad, obs())


@pytest.mark.parametrize(("numels", "fraction", "count"), [
    ([10, 10, 10, 10], 0.5, 2),
    ([10, 10, 10, 10], 0.3, 1),  # 10 is nearer 12 than 20 is
    ([10, 10, 10, 10], 0.4, 2),  # 20 is nearer 16 than 10 is
    ([10, 10, 10, 10], 0.01, 0),
    ([10, 10, 10, 10], 0.99, 4),
    ([100, 1, 1, 1], 0.5, 1),  # 100 of 103 is nearer 51.5 than 0 is
    ([1, 1, 1, 100], 0.5, 3),  # the next bucket (100) would overshoot by far more
    ([], 0.5, 0),
])
def test_a_fixed_share_counts_the_first_buckets_nearest_the_fraction(numels, fraction, count):
    assert share_count(numels, fraction) == count


def test_a_share_fraction_outside_0_1_is_a_bug():
    with pytest.raises(ValueError, match="outside"):
        share_count([1, 2], 1.5)
