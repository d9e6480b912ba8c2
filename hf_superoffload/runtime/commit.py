"""Commit: the moment (and master) stores a deferred host pass still owes, and the share of buckets that defer.

[Note: deferred moments] and [Note: adaptive master deferral] in docs/design.md. A verdict-known host pass of a
bucket may leave ``exp_avg``/``exp_avg_sq`` (and, for the first ``master_count`` host buckets, the fp32 master)
unstored and record a :class:`~.bucket.MomentCommit`; :meth:`MomentCommits.commit` stores them later, in any
thread, exactly once: when the worker is idle, at the bucket's next CPU task, or when a reader needs the state.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from .. import ops
from ..planning.plan import MasterDeferral, OffloadPlan
from .bucket import HostBucket
from .cpu_worker import CpuWorker, WorkerError
from .layout import BucketLayout
from .master_deferral import COMMIT_BYTES, DeferralObservation, DeferralSplit, next_split
from .telemetry import Telemetry

__all__ = ["MomentCommits"]


def _released() -> None:
    """A gate that is already open: the task waits only for the gates queued before it."""


class MomentCommits:
    """Owns the deferred stores of the host buckets and the adaptive master share.

    Attributes:
        enabled: the plan defers the moment stores (``plan.defer_moments``); everything here is a no-op without.
        split: this step's split: the first ``split.moments`` host buckets leave their moments to the commit
            (every one but where the adaptive split gave some back: [Note: adaptive moment deferral] in
            master_deferral.py), the first ``split.masters`` the fp32 master too (all of them, none, or a share
            moved each step). One frozen value, replaced whole: a worker reads both counts of one split.
    """

    layout: BucketLayout
    enabled: bool
    split: DeferralSplit
    _mode: MasterDeferral
    _worker: CpuWorker
    _telemetry: Telemetry
    _timeout_s: float
    _mark_inconsistent: Callable[[], None]
    _lock: threading.Lock
    _clock: list[float]
    """Seconds and bytes of commit work since the last verdict (under ``_lock``): the measured commit rate."""
    _rate: float
    _done_at: float | None
    """When the last idle-commit chain finished (None: still running, or it committed nothing; under ``_lock``)."""
    _shards: list[int]

    def __init__(self, *, plan: OffloadPlan, layout: BucketLayout, worker: CpuWorker, telemetry: Telemetry,
                 timeout_s: float, mark_inconsistent: Callable[[], None]) -> None:
        self.layout = layout
        self.enabled = plan.defer_moments
        self._mode = plan.defer_master
        self._worker, self._telemetry = worker, telemetry
        self._timeout_s = timeout_s
        self._mark_inconsistent = mark_inconsistent
        self._lock = threading.Lock()
        self._shards = [b.spec.shard for b in layout.host_buckets]
        n = len(layout.host_buckets)
        self.split = DeferralSplit(n, n if self._mode is MasterDeferral.ALL else plan.master_buckets)
        self._clock = [0.0, 0.0]
        self._rate = 0.0
        self._done_at = None

    @property
    def _plan(self) -> OffloadPlan:
        """The layout's plan (a move to the host replaces it: [Note: moving the tail to the host])."""
        return self.layout.plan

    def relayout(self) -> None:
        """Buckets moved between the device tail and the host ([Note: moving the tail to the host], [Note: moving
        the tail to the device]): the share counts the host buckets now there (an adaptive share at most all of
        them), and the deferred stores follow the new plan (nothing is pending: the engine committed it before the
        move)."""
        plan = self._plan
        moments, masters = self.split.moments, self.split.masters
        all_moments = moments >= len(self._shards)
        self._shards = [b.spec.shard for b in self.layout.host_buckets]
        n = len(self._shards)
        if self._mode is not plan.defer_master:
            self._mode, masters = plan.defer_master, plan.master_buckets
        self.enabled = plan.defer_moments
        if self._mode is MasterDeferral.ALL:
            masters = n
        elif self._mode is MasterDeferral.SHARE:
            masters = plan.master_buckets
        # an adaptive split keeps its place on the line, within the buckets now on the host
        moments = min(moments, n) if self.adaptive and not all_moments else n
        self.split = DeferralSplit(moments, min(masters, n) if moments == n else 0)

    @property
    def master_count(self) -> int:
        return self.split.masters

    @property
    def moment_count(self) -> int:
        return self.split.moments

    def defers(self, b: HostBucket) -> tuple[bool, bool]:
        """Whether ``b``'s verdict-known pass of this step leaves its moments, and the fp32 master too, to the
        commit (one read of the split)."""
        if not self.enabled:
            return False, False
        split, rank = self.split, self.layout.host_rank[b.index]
        return rank < split.moments, rank < split.masters

    @property
    def adaptive(self) -> bool:
        return self._mode is MasterDeferral.ADAPTIVE

    def commit(self, b: HostBucket) -> None:
        """Store the moments a deferred step of ``b`` still owes, if any. Any thread; ``b.commit_lock`` makes it
        happen once and makes a concurrent caller wait until it is done.

        The commit belongs to the last completed step. Double buffer: it reads copy ``src`` and writes copy ``dst``,
        so a failed commit can simply run again (the record stays); in place a failed one leaves the moments half
        written: the engine is marked inconsistent.
        """
        with b.commit_lock:
            c = b.pending
            if c is None:
                return
            t0 = time.perf_counter()
            (p_src, m_src, v_src), (p, m, v) = b.pmv[c.src], b.pmv[c.dst]
            try:
                with torch.profiler.record_function("superoffload::moment_commit"):
                    for r in c.runs:
                        sl = slice(r.start, r.end)
                        if c.master:  # the whole step again, bit for bit, without the bf16 copy
                            ops.cpu_adamw_step_(
                                p[sl], c.grad[sl], m[sl], v[sl], step=r.step, hyper=c.hypers[r.group],
                                grad_scale=c.grad_scale,
                                source=(p_src[sl], m_src[sl], v_src[sl]) if c.dst != c.src else None,
                                num_threads=self._plan.cpu_threads,
                            )
                            continue
                        ops.cpu_adamw_moments_(
                            c.grad[sl], m[sl], v[sl], hyper=c.hypers[r.group], grad_scale=c.grad_scale,
                            source=(m_src[sl], v_src[sl]) if c.dst != c.src else None,
                            num_threads=self._plan.cpu_threads,
                        )
            except BaseException:
                if c.dst == c.src:
                    self._mark_inconsistent()
                raise
            b.pending = None
        seconds = time.perf_counter() - t0
        self._telemetry.add(commit_s=seconds)
        with self._lock:
            self._clock[0] += seconds
            self._clock[1] += b.spec.shard * COMMIT_BYTES[c.master]

    def queue_idle(self, k: int = 0) -> None:
        """Store the pending moments of host buckets ``k``, ``k + 1``, ... one task at a time, at the lowest worker
        priority (after every finishing task and every task of the next backward), in the next backward's arrival
        order. Each task queues the next: ``step()`` submits one task, and a more urgent task never waits for more
        than one bucket's commit. A failed worker: its error reaches the training thread at its next interaction."""
        buckets = self.layout.host_buckets
        if k >= len(buckets):
            return
        b = buckets[k]
        if k == 0:
            with self._lock:
                self._done_at = None

        def task() -> None:
            self.commit(b)
            if k + 1 == len(buckets):
                with self._lock:  # [Note: adaptive master deferral]: the slack before the next verdict
                    self._done_at = time.perf_counter()
            self.queue_idle(k + 1)

        # [Note: D2H gate]: the chain enters the queue behind every gated first task of this step (the gates run
        # in submission order), so those run first and the chain finds their pending moments
        gate = _released if k == 0 and self._plan.d2h_gate else None
        with contextlib.suppress(WorkerError):
            self._worker.submit(len(self.layout.buckets) + k, f"idle moment commit of {b.describe()}", task,
                                gate=gate)

    def commit_all(self, *, step_in_progress: bool) -> None:
        """Store every pending deferred moment (training thread): readers of the host state call it. Between
        steps it first waits for the worker's queued tasks, which may record commits."""
        if not self.enabled:
            return
        if not step_in_progress and not self._worker.failed:
            self._worker.drain(self._timeout_s)
        for b in self.layout.host_buckets:
            self.commit(b)

    def drop_pending(self, *, step_in_progress: bool) -> None:
        """Forget the pending moment commits: a loaded state replaces the moments they would store."""
        if not self.enabled:
            return
        if not step_in_progress and not self._worker.failed:
            self._worker.drain(self._timeout_s)
        for b in self.layout.host_buckets:
            with b.commit_lock:
                b.pending = None

    @property
    def pending(self) -> int:
        """Host buckets whose deferred moments are not stored yet."""
        return sum(b.pending is not None for b in self.layout.host_buckets)

    def adapt_share(self) -> None:
        """[Note: adaptive master deferral], [Note: adaptive moment deferral]: move the split of deferring buckets
        before this step's pass,
        from the commit work still pending now and how early the last commits finished."""
        now = time.perf_counter()
        pending_bytes = 0.0
        for b in self.layout.host_buckets:
            c = b.pending  # read without the commit lock: an estimate (the worker may be storing it right now)
            if c is not None:
                pending_bytes += b.spec.shard * COMMIT_BYTES[c.master]
        with self._lock:
            seconds, nbytes = self._clock
            self._clock = [0.0, 0.0]
            done_at = self._done_at
        if nbytes > 0:
            self._rate = seconds / nbytes
        # slack counts only after commits that did something (a speculative step's empty chain says nothing)
        slack = now - done_at if (done_at is not None and nbytes > 0 and not pending_bytes) else 0.0
        self.split = next_split(self._shards, self.split, DeferralObservation(pending_bytes, slack, self._rate))
