"""The rule of adaptive master deferral ([Note: adaptive master deferral] in docs/design.md).

A verdict-known host pass that leaves the fp32 master to the commit moves 16 instead of 20 B/param on the critical
path, and its commit 26 instead of 18 B/param off it. That trade pays only while the commits fit in the worker's
idle time (the next backward); a commit still pending when the next verdict comes runs on the critical path. The
plan says whether the split is adaptive (``MasterDeferral.ADAPTIVE``); this pure function moves it, once per step,
from two measurements: the commit work still pending at the verdict (too much deferred) and how long before the
verdict the commits were done (room for more). The engine only measures and applies it.

[Note: adaptive moment deferral]
The same line goes on below a master share of none: the verdict-known passes of the last buckets then store their
moments too (28 B/param, nothing owed). Deferred moments run in two regimes on the H100 box's 8B batch-4 snippet
(4.0B parameters' state on the host, speculation committing), and a run falls into either:

* most buckets are stepped speculatively in the backward, the pass after the verdict is small (``pass_s`` 0.2 s),
  so are its commits, and the GPU never waits: 1.08-1.14 s a step;
* the worker enters the backward still owing the last step's commits, each bucket's first task stores them before
  its speculative step ([Note: deferred moments]), the speculation falls behind the gradients, more buckets wait
  for the verdict, their passes owe more commits (0.65 s a step) and the next backward starts behind again:
  1.27-1.40 s a step, the GPU idle 0.2-0.3 s of each waiting for the host pass.

Three of five runs of the row stayed in the second (two of them probing every master for a step or two, which
changed nothing: the commits grow), the two others left it when a step of slack moved the master share; a master
share cannot leave it by itself, since none is deferred there. The
moments are the commits that sustain it, so pending work at the verdict now gives them back too, the last
buckets first (the idle chain stores commits in arrival order: the last ones are the ones still pending), and
slack adds them back before any master. The first bucket always defers its moments: slack is measured only after
commits that did something, so with none left deferred nothing could bring them back. Storing them in the pass costs 8 B/param more on the critical path for
the buckets given back; any split gives the same bits (the commit stores what the fused pass would).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["COMMIT_BYTES", "MASTER_EXTRA_BYTES", "MOMENTS_KEPT", "DeferralObservation", "DeferralSplit",
           "next_split"]

COMMIT_BYTES = {False: 18, True: 26}
"""Host bytes per parameter a commit moves: moments only (False) or the whole step again (True)."""
MASTER_EXTRA_BYTES = COMMIT_BYTES[True] - COMMIT_BYTES[False]
"""What deferring one parameter's master adds to its commit (and it saves 4 B on the critical pass)."""
MOMENTS_KEPT = 1
"""Buckets that always defer their moments ([Note: adaptive moment deferral]): their commits keep the rate and the
slack measured, without which buckets given back could never come back."""


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


@dataclass(frozen=True, slots=True)
class DeferralSplit:
    """Which host buckets' verdict-known passes leave stores to the commit, in the engine's share order: the first
    ``moments`` leave m and v (20 instead of 28 B/param in the pass, an 18 B/param commit), the first ``masters``
    of those the fp32 master too (16 B/param in the pass, a 26 B/param commit). The rest store everything in the
    pass and owe nothing. ``masters`` is nonzero only when every bucket defers its moments."""

    moments: int
    masters: int

    def check(self, buckets: int) -> None:
        if not (0 <= self.masters <= self.moments <= buckets and (self.masters == 0 or self.moments == buckets)):
            raise ValueError(f"split {self} is outside the {buckets} buckets' order (masters only once every "
                             "bucket defers its moments)")


def next_split(numels: Sequence[int], split: DeferralSplit, obs: DeferralObservation, *,
               gain: float = 0.5) -> DeferralSplit:
    """The split for the next verdict-known pass ([Note: adaptive moment deferral]), one bucket's stores at a time
    along one line: the masters' slots above the moments' (the last bucket's master is the first given back, the
    last bucket's moments only once no master is deferred).

    Pending work gives back slots until their commit bytes cover it (8 B/param a master, 18 B/param the moments;
    any pending work at least one slot; never the first ``MOMENTS_KEPT`` buckets' moments); slack adds the whole slots whose commit bytes fit in ``gain`` times the
    slack at the measured rate (the gain damps the estimate; a slot that does not fit whole is not added, so the
    split settles instead of oscillating).
    """
    n = len(numels)
    split.check(n)
    moments, masters = split.moments, split.masters
    if obs.pending_bytes > 0:
        excess = obs.pending_bytes
        while excess > 0 and moments > min(MOMENTS_KEPT, n):
            if masters:
                masters -= 1
                excess -= numels[masters] * MASTER_EXTRA_BYTES
            else:
                moments -= 1
                excess -= numels[moments] * COMMIT_BYTES[False]
        return DeferralSplit(moments, masters)
    if obs.slack_s > 0 and obs.rate_s_per_byte > 0:
        room = gain * obs.slack_s / obs.rate_s_per_byte
        while masters < n:
            cost = numels[moments] * COMMIT_BYTES[False] if moments < n else numels[masters] * MASTER_EXTRA_BYTES
            if cost > room:
                break
            room -= cost
            if moments < n:
                moments += 1
            else:
                masters += 1
    return DeferralSplit(moments, masters)
