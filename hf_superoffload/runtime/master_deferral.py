"""The rule of adaptive master deferral ([Note: adaptive master deferral] in docs/design.md).

A verdict-known host pass that leaves the fp32 master to the commit moves 16 instead of 20 B/param on the critical
path, and its commit 26 instead of 18 B/param off it. That trade pays only while the commits fit in the worker's
idle time (the next backward); a commit still pending when the next verdict comes runs on the critical path. The
plan says whether the split is adaptive (``MasterDeferral.ADAPTIVE``); this pure function moves it, once per step,
from two measurements: the commit work still pending at the verdict (too much deferred) and how long before the
verdict the commits were done (room for more). The engine only measures and applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["COMMIT_BYTES", "MASTER_EXTRA_BYTES", "DeferralObservation", "next_share"]

COMMIT_BYTES = {False: 18, True: 26}
"""Host bytes per parameter a commit moves: moments only (False) or the whole step again (True)."""
MASTER_EXTRA_BYTES = COMMIT_BYTES[True] - COMMIT_BYTES[False]
"""What deferring one parameter's master adds to its commit (and it saves 4 B on the critical pass)."""


@dataclass(frozen=True, slots=True)
class DeferralObservation:
    """What the engine measured about the last commits when a verdict came.

    Attributes:
        pending_bytes: commit work (bytes of host traffic) still pending at the verdict: it will run on the
            critical path of the coming pass.
        slack_s: seconds between the last commit finishing and the verdict (0 when some were still pending).
        rate_s_per_byte: measured seconds per byte of commit work (0: not measured yet).
    """

    pending_bytes: float
    slack_s: float
    rate_s_per_byte: float


def next_share(numels: Sequence[int], count: int, obs: DeferralObservation, *, gain: float = 0.5) -> int:
    """How many buckets (the first ``count`` of ``numels``, in the engine's share order) defer their master next.

    Pending work shrinks the share by at least ``pending_bytes / 8`` parameters (what removes that much commit
    work); slack grows it by whole buckets whose extra commit fits in ``gain`` times the slack (the gain damps the
    estimate, and a bucket that does not fit whole is not added, so the share settles instead of oscillating).
    """
    if not 0 <= count <= len(numels):
        raise ValueError(f"count={count} is outside [0, {len(numels)}]")
    if obs.pending_bytes > 0:
        excess = obs.pending_bytes / MASTER_EXTRA_BYTES
        while count > 0 and excess > 0:
            count -= 1
            excess -= numels[count]
        return count
    if obs.slack_s > 0 and obs.rate_s_per_byte > 0:
        room = gain * obs.slack_s / (MASTER_EXTRA_BYTES * obs.rate_s_per_byte)
        while count < len(numels) and numels[count] <= room:
            room -= numels[count]
            count += 1
    return count
