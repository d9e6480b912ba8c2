"""The adaptive master-deferral rule ([Note: adaptive master deferral]): a pure function of what was measured."""

from __future__ import annotations

import pytest

from hf_superoffload.planning.planner import share_count
from hf_superoffload.runtime.master_deferral import MASTER_EXTRA_BYTES, DeferralObservation, next_share

NUMELS = [100, 300, 50, 200, 100]


def obs(pending: float = 0.0, slack: float = 0.0, rate: float = 1e-3) -> DeferralObservation:
    return DeferralObservation(pending_bytes=pending, slack_s=slack, rate_s_per_byte=rate)


def test_pending_work_removes_enough_buckets_to_cover_it():
    # 8 B/param extra per deferred master: 1600 B pending = 200 params to give back
    assert next_share(NUMELS, 4, obs(pending=200 * MASTER_EXTRA_BYTES)) == 3  # the 4th bucket holds 200
    assert next_share(NUMELS, 4, obs(pending=201 * MASTER_EXTRA_BYTES)) == 2  # one more: 50 more params
    assert next_share(NUMELS, 4, obs(pending=1.0)) == 3  # any pending work gives back at least one bucket
    assert next_share(NUMELS, 2, obs(pending=1e12)) == 0  # never below none
    assert next_share(NUMELS, 0, obs(pending=1e12, slack=5.0)) == 0


def test_slack_adds_only_whole_buckets_that_fit_half_of_it():
    # rate 1e-3 s/B, gain 0.5: slack 1.6 s = 0.8 s of room = 800 B = 100 params of extra master work
    assert next_share(NUMELS, 0, obs(slack=1.6)) == 1  # the first bucket (100) fits exactly
    assert next_share(NUMELS, 1, obs(slack=1.6)) == 1  # the next one (300) does not: no change, no oscillation
    assert next_share(NUMELS, 0, obs(slack=1e9)) == len(NUMELS)  # never beyond all
    assert next_share(NUMELS, 0, obs(slack=1.6, rate=0.0)) == 0  # no measured rate: no guess
    assert next_share(NUMELS, 3, obs()) == 3  # nothing measured: unchanged


def test_a_share_outside_the_buckets_is_a_bug():
    with pytest.raises(ValueError, match="outside"):
        next_share(NUMELS, 6, obs())


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
