"""The host pass: the CPU worker's half of a host bucket's step: speculate or defer, finish for the verdict, undo.

``run`` is queued by the flush once a bucket's gradients are on their way to the host; ``finish_task`` by
``step()`` once the verdict is known. [Note: speculation and rollback], [Note: deferred moments] and
[Note: stream ordering] in docs/design.md say why it works this way. The finished bucket is handed to
:class:`~.upload.Uploads`; a deferred store it still owes is recorded for :class:`~.commit.MomentCommits`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import ops
from ..planning.plan import OffloadPlan
from .accumulation import HostAccumulator
from .bucket import BucketState, HostBucket, MomentCommit
from .commit import MomentCommits
from .cpu_worker import CpuWorker
from .layout import BucketLayout
from .telemetry import Telemetry
from .upload import Uploads
from .validation import Hyper, StepVerdict, Verdict

__all__ = ["HostPass", "StepContext"]

logger = logging.getLogger("hf_superoffload")


@dataclass(slots=True)
class StepContext:
    """What the CPU tasks of one optimizer step share. Guarded by the bucket-state lock."""

    speculative: bool
    spec_hyper: Hyper
    max_grad_norm: float | None
    src: int
    """Host state copy this step reads (double buffer: the current one)."""
    dst: int
    """Host state copy this step writes (double buffer: the other one; in place: ``src``)."""
    verdict: Verdict | None = None
    saw_nonfinite: bool = False
    partial_sumsq: float = 0.0
    """Sum of squares of the host buckets the worker has seen: a lower bound of the global norm."""
    clip_certain: bool = False
    """The partial norm already exceeds max_grad_norm: clipping will fire, so speculating is wasted work."""
    failed: bool = False
    """A bucket's CPU task failed before the verdict: ``step()`` must not publish one (it aborts the step)."""
    verdict_at: float = 0.0
    finished: int = 0
    pass_done_at: float | None = None
    """Telemetry (``StepStats.pass_s``): when the verdict was published, how many host buckets have finished for it
    since, and when the last one did."""
    started: float = field(default_factory=time.perf_counter)


class HostPass:
    """Owns the CPU Adam of the host buckets: the speculative step, the verdict's finish (commit, redo or undo).

    Every bucket transition happens under ``lock``, the engine's bucket-state lock, which also guards the
    :class:`StepContext` the training thread publishes its verdict in.
    """

    layout: BucketLayout
    lock: threading.Lock
    _plan: OffloadPlan
    _worker: CpuWorker
    _timeout_s: float
    _telemetry: Telemetry
    _commits: MomentCommits
    _uploads: Uploads
    _accum: HostAccumulator | None
    _div: float
    """Gradients are summed over the ranks and divided by this (folded into the Adam's grad scale)."""
    _mark_inconsistent: Callable[[], None]

    def __init__(self, *, plan: OffloadPlan, layout: BucketLayout, lock: threading.Lock, worker: CpuWorker,
                 timeout_s: float, telemetry: Telemetry, commits: MomentCommits, uploads: Uploads,
                 accum: HostAccumulator | None, grad_divisor: float, mark_inconsistent: Callable[[], None]) -> None:
        self._plan, self.layout, self.lock = plan, layout, lock
        self._worker, self._timeout_s = worker, timeout_s
        self._telemetry, self._commits, self._uploads, self._accum = telemetry, commits, uploads, accum
        self._div = grad_divisor
        self._mark_inconsistent = mark_inconsistent

    def run(self, b: HostBucket, ctx: StepContext) -> None:
        """The first CPU task of ``b`` in a step: speculate, or defer until the verdict."""
        try:
            self._run(b, ctx)
        except BaseException:
            with self.lock:
                if ctx.verdict is None:
                    ctx.failed = True  # step() raises instead of validating: abort_step restores the state
                elif ctx.verdict.kind is not StepVerdict.SKIP:
                    self._mark_inconsistent()  # a validated step needed this bucket: it cannot be completed
            raise

    def _run(self, b: HostBucket, ctx: StepContext) -> None:
        assert b.d2h is not None
        self._commits.commit(b)  # the last step's deferred moments, before anything reads them (CPU idle: backward)
        b.d2h.wait_host()
        if b.accumulated:  # host accumulation: the boundary add (queued before this task) computed them
            assert self._accum is not None
            sumsq, nonfinite_count = self._accum.stats(b)
        else:
            sumsq, nonfinite_count = self.layout.grad_stats_host[b.index].sum(dim=0).tolist()
        with self.lock:
            verdict = ctx.verdict
            if verdict is None:
                ctx.saw_nonfinite |= nonfinite_count > 0
                ctx.partial_sumsq += sumsq / self._div**2
                if ctx.max_grad_norm and math.sqrt(ctx.partial_sumsq) + 1e-6 > ctx.max_grad_norm:
                    ctx.clip_certain = True
                if not ctx.speculative or ctx.saw_nonfinite or ctx.clip_certain:
                    b.to_deferred()
                    return
            b.to_running()
        if verdict is not None:
            self._finish(b, ctx, verdict, speculated=False)
            return
        self._cpu_step(b, ctx, ctx.spec_hyper, 1.0 / self._div)
        self._telemetry.add(speculated_buckets=1)
        with self.lock:
            verdict = ctx.verdict
            if verdict is None:
                b.to_speculated()
                return
        self._finish(b, ctx, verdict, speculated=True)

    def abort(self, ctx: StepContext) -> None:
        """Finish the step of ``ctx`` as SKIP before any verdict was published: speculative updates are undone.

        If the worker itself failed, the undo runs here, in the calling thread. A bucket whose CPU step raised
        part-way (state RUNNING) cannot be restored and is named in the log.
        """
        skip = Verdict(StepVerdict.SKIP, 1.0, ctx.spec_hyper, float("nan"))
        with self.lock:
            ctx.verdict = skip
            pending = [(b, b.state is BucketState.SPECULATED) for b in self.layout.host_buckets
                       if b.state in (BucketState.SPECULATED, BucketState.DEFERRED)]
            broken = [b for b in self.layout.host_buckets if b.state is BucketState.RUNNING]
        if self._worker.failed:
            for b, spec in pending:
                self.finish_task(b, ctx, skip, spec)
            for b in broken:
                logger.error("hf_superoffload: %s failed inside its CPU step; its state may be partly updated", b.describe())
                if ctx.dst == ctx.src:
                    self._mark_inconsistent()  # stepped in place: the committed state itself may be half updated
                elif b.staging is not None:
                    b.staging.copy_(b.pmv[ctx.src][0])  # double buffer: the committed copy is intact
                b.ready.set()
        else:
            for b, spec in pending:
                self._worker.submit(self.layout.need_order(b), f"aborting {b.describe()}",
                                    lambda b=b, spec=spec: self.finish_task(b, ctx, skip, spec))
            self._worker.drain(self._timeout_s)

    def finish_task(self, b: HostBucket, ctx: StepContext, verdict: Verdict, speculated: bool) -> None:
        """The task ``step()`` queues for a SPECULATED or DEFERRED bucket once ``verdict`` is known."""
        with self.lock:
            b.to_running()
        self._finish(b, ctx, verdict, speculated=speculated)

    def _finish(self, b: HostBucket, ctx: StepContext, verdict: Verdict, *, speculated: bool) -> None:
        """Bring a RUNNING bucket to its final state for ``verdict``."""
        try:
            self._finish_unguarded(b, ctx, verdict, speculated=speculated)
        except BaseException:
            if verdict.kind is not StepVerdict.SKIP:
                self._mark_inconsistent()  # a validated step is half applied: refuse to checkpoint it
            raise

    def _finish_unguarded(self, b: HostBucket, ctx: StepContext, verdict: Verdict, *, speculated: bool) -> None:
        if speculated and not (verdict.kind is StepVerdict.COMMIT and b.applied == (verdict.hyper, verdict.grad_scale)):
            self._telemetry.add(wasted_buckets=1)
        if verdict.kind is StepVerdict.SKIP:
            if speculated:
                self._undo(b, ctx)
            with self.lock:
                b.to_idle_skipped()
            self._uploads.forget(b)
            return
        if not (speculated and b.applied == (verdict.hyper, verdict.grad_scale)):
            if speculated:
                self._undo(b, ctx)
            # the verdict is known: with deferred moments this pass stores p and the bf16 weights only (with
            # deferred master stores the bf16 weights only)
            defer = self._commits.enabled
            late_master = self._commits.defers_master(b)
            self._cpu_step(b, ctx, verdict.hyper, verdict.grad_scale, store_moments=not defer,
                           store_master=not late_master)
            if defer and b.runs:
                master = None
                if late_master:
                    master = tuple((verdict.hyper[r.group][0], *verdict.hyper[r.group][3:5]) for r in b.runs)
                record = MomentCommit(runs=b.runs, betas=tuple(verdict.hyper[r.group][1:3] for r in b.runs),
                                      grad_scale=verdict.grad_scale, src=ctx.src, dst=ctx.dst, grad=b.grad,
                                      master=master)
                with b.commit_lock:
                    assert b.pending is None, "a moment commit was still pending when its bucket stepped again"
                    b.pending = record
        if ctx.dst != ctx.src:  # parameters without a gradient keep their state in the new copy too
            for start, end in b.gaps:
                for d, s_ in zip(b.pmv[ctx.dst], b.pmv[ctx.src]):
                    d[start:end].copy_(s_[start:end])
        self._uploads.hand_over(b, ctx.dst)
        with self.lock:  # StepStats.pass_s: the worker has handed over this step's last host bucket
            ctx.finished += 1
            if ctx.finished == len(self.layout.host_buckets):
                ctx.pass_done_at = time.perf_counter()

    def _cpu_step(self, b: HostBucket, ctx: StepContext, hyper: Hyper, scale: float, *,
                  store_moments: bool = True, store_master: bool = True) -> None:
        """AdamW on ``b``'s stepped slices: read state copy ``ctx.src``, write ``ctx.dst`` (the same in place).

        ``store_moments=False``: p and staging only; the caller records the :class:`MomentCommit` that stores m/v
        (``store_master=False`` as well: staging only, the commit stores p too).
        """
        t0 = time.perf_counter()
        (p_src, m_src, v_src), (p, m, v) = b.pmv[ctx.src], b.pmv[ctx.dst]
        with torch.profiler.record_function("superoffload::cpu_adam"):
            for r in b.runs:
                lr, beta1, beta2, eps, wd = hyper[r.group]
                sl = slice(r.start, r.end)
                ops.cpu_adamw_step_(
                    p[sl], b.grad[sl], m[sl], v[sl],
                    step=r.step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, grad_scale=scale,
                    param_bf16_out=b.staging[sl] if b.staging is not None else None,
                    source=(p_src[sl], m_src[sl], v_src[sl]) if ctx.dst != ctx.src else None,
                    num_threads=self._plan.cpu_threads, store_moments=store_moments, store_master=store_master,
                )
        b.applied = (hyper, scale)
        self._telemetry.add(cpu_s=time.perf_counter() - t0)

    def _undo(self, b: HostBucket, ctx: StepContext) -> None:
        """Take back a speculative step. Double buffer: the source copy is intact, only staging is refreshed."""
        assert b.applied is not None
        hyper, scale = b.applied
        t0 = time.perf_counter()
        p, m, v = b.pmv[ctx.src]
        with torch.profiler.record_function("superoffload::undo"):
            for r in b.runs:
                sl = slice(r.start, r.end)
                if ctx.dst == ctx.src:
                    lr, beta1, beta2, eps, wd = hyper[r.group]
                    ops.cpu_adamw_undo_(
                        p[sl], b.grad[sl], m[sl], v[sl],
                        step=r.step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, grad_scale=scale,
                        param_bf16_out=None, num_threads=self._plan.cpu_threads,
                    )
                if b.staging is not None:
                    b.staging[sl].copy_(p[sl])
        b.applied = None
        self._telemetry.add(cpu_s=time.perf_counter() - t0)
