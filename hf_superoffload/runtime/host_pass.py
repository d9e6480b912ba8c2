"""The host pass: the CPU worker's half of a host bucket's step: speculate or defer, finish for the verdict, undo.

``run`` is queued by the flush once a bucket's gradients are on their way to the host; ``finish_task`` by
``step()`` once the verdict is known. [Note: speculation and rollback], [Note: deferred moments] and
[Note: stream ordering] in docs/design.md say why it works this way. The finished bucket is handed to
:class:`~.upload.Uploads`; a deferred store it still owes is recorded for :class:`~.commit.MomentCommits`.

[Note: one path per bucket]

Where the inverse rollback (in place) has no deferred stores ([Note: deferred speculation] in docs/design.md says
where it has, and undoes nothing) it undoes a speculative step algebraically, exact to fp32 rounding only, so a bucket
speculated, undone and redone (or skipped) ends a few roundings away from one stepped (or left alone) knowing the
verdict. Which buckets the worker reaches before the verdict is a timing accident (its speed, the order it takes
queued tasks in, the partial norm summed by then), so the same run gave other bits whenever it clipped or skipped.
In a speculative step on an in-place state (``StepContext.one_path``) data alone fixes a bucket's arithmetic:

- a finite gradient takes the speculative path: step with the speculative hyper-parameters and scale, then on REDO
  the inverse undo and the verdict's step, on SKIP the inverse undo. Reached after a COMMIT verdict, it is stepped
  once (the same bits as a speculative step that stands);
- a non-finite gradient is never stepped before the verdict.

Timing decides only when the speculative step runs (overlapping the backward, or in the bucket's first task after
the verdict), never whether. So neither a non-finite gradient seen nor a partial norm above ``max_grad_norm`` stops
speculating later buckets here, unlike the double buffer (where an unspeculated bucket is work saved): they need
the speculative step anyway, and before the verdict it overlaps the backward. Steps that do not speculate
(speculation off, or paused by the governor, which follows the verdicts only) step every bucket once, as before.

Cost, only in speculative steps whose verdict is REDO or SKIP: each bucket the worker had not speculated pays a
speculative step and an undo on top. When clipping fires often the governor pauses speculation, so the
clip-every-step case pays on its first step only. No switch turns it off: it is the inverse rollback's run-to-run
determinism, and the governor bounds its cost. Measured on CPU (2 shared cores, 2026-12-04): on a 25M-element
bucket a speculative step takes 23 ms, the undo 18 ms, a verdict-known step without moment stores 20 ms (~3x for a
bucket not reached). A 6M-parameter Llama (11 host buckets, 22 steps, 1 Adam thread): the worker's seconds per step
stayed within the box's noise (+-30%) without clipping, with clipping on every step (default governor) and on half
the steps; with clipping on every step and speculation forced on (``PlannerOverrides(max_redo_rate=1.0)``) they
went from 0.005 to 0.030-0.035 s: every bucket stepped, undone and stepped again instead of stepped once.

Not taken: a snapshot of each speculated bucket's prior state (an exact undo) needs host memory the planner must
budget, where the inverse rollback was chosen because a second 12 B/param copy does not fit, and moves 24 B/param
more per speculated bucket, committed or not. Where deferred moments are on, a speculative step stores only the bf16
weights instead ([Note: deferred speculation]): every undo is free and exact, at a 26 B/param commit per committed
speculative step; this rule then does not apply (``StepContext.bf16_only``).
"""

from __future__ import annotations

import contextlib
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
from .telemetry import PassRecord, Telemetry
from .upload import Uploads
from .validation import GroupHypers, SpeculationGovernor, StepVerdict, Verdict

__all__ = ["HostPass", "StepContext"]

logger = logging.getLogger("hf_superoffload")


@dataclass(slots=True)
class StepContext:
    """What the CPU tasks of one optimizer step share. Guarded by the bucket-state lock."""

    speculative: bool
    spec_hypers: GroupHypers
    max_grad_norm: float | None
    src: int
    """Host state copy this step reads (double buffer: the current one)."""
    dst: int
    """Host state copy this step writes (double buffer: the other one; in place: ``src``)."""
    one_path: bool = False
    """A speculative step on an in-place state whose undo is algebraic (the inverse rollback without deferred
    speculation): every bucket with a finite gradient takes the speculative path, whenever the worker reaches it
    ([Note: one path per bucket])."""
    bf16_only: bool = False
    """A speculative step under the plan's deferred speculation: a speculative pass writes the bf16 weights only,
    p, m, v keep the pre-step state until the commit ([Note: deferred speculation] in docs/design.md)."""
    verdict: Verdict | None = None
    saw_nonfinite: bool = False
    partial_sumsq: float = 0.0
    """Sum of squares of the host buckets the worker has seen: a lower bound of the global norm."""
    clip_certain: bool = False
    """The partial norm already exceeds max_grad_norm: clipping will fire, so speculating is wasted work (unless
    ``one_path``)."""
    failed: bool = False
    """A bucket's CPU task failed before the verdict: ``step()`` must not publish one (it aborts the step)."""
    verdict_at: float = 0.0
    finished: int = 0
    pass_done_at: float | None = None
    """Telemetry (``StepStats.pass_s``): when the verdict was published, how many host buckets have finished for it
    since, and when the last one did."""
    threads: int = 1
    """CPU Adam threads of this step's passes, fixed when it opens: a pass never mixes two counts (the thread
    trial compares whole passes)."""
    adam_s: float = 0.0
    redone: int = 0
    """Telemetry (``PassRecord``): the worker's seconds in Adam and undo for this step's host buckets, its
    speculative share included, and how many of them it stepped again after a speculative step that did not stand
    (the worker alone writes them; read once ``pass_done_at`` is set)."""
    started: float = field(default_factory=time.perf_counter)


class HostPass:
    """Owns the CPU Adam of the host buckets: the speculative step, the verdict's finish (commit, redo or undo).

    Every bucket transition happens under ``lock``, the engine's bucket-state lock, which also guards the
    :class:`StepContext` the training thread publishes its verdict in. The training thread opens a step's context
    (``begin_step``), publishes its verdict and queues the finishes (``publish``, ``queue_finishes``) and closes it
    (``end_step``); the worker runs the tasks.
    """

    layout: BucketLayout
    lock: threading.Lock
    ctx: StepContext | None
    """The step in progress: from its first offloaded gradient until its ``step()`` (or abort)."""
    _pass_ctx: StepContext | None
    """The last validated step's context: its pass runs until the next ``step()`` (StepStats.pass_s)."""
    _gatherer: CpuWorker | None
    """Data parallel: the thread of the last step's all-gathers (they precede this step's reduce-scatters)."""
    _governor: SpeculationGovernor
    _hypers_fn: Callable[[], GroupHypers]
    _max_grad_norm_fn: Callable[[], float | None]
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
                 accum: HostAccumulator | None, grad_divisor: float, mark_inconsistent: Callable[[], None],
                 governor: SpeculationGovernor, hypers_fn: Callable[[], GroupHypers],
                 max_grad_norm_fn: Callable[[], float | None], gatherer: CpuWorker | None) -> None:
        """
        Args:
            hypers_fn: the live per-group hyper-parameters, read when a step opens (its speculation uses them).
            max_grad_norm_fn: the clipping threshold, read when a step opens (a partial norm above it stops
                speculating).
        """
        self.layout, self.lock = layout, lock
        self.ctx = self._pass_ctx = None
        self._governor, self._hypers_fn, self._max_grad_norm_fn = governor, hypers_fn, max_grad_norm_fn
        self._gatherer = gatherer
        self._worker, self._timeout_s = worker, timeout_s
        self._telemetry, self._commits, self._uploads, self._accum = telemetry, commits, uploads, accum
        self._div = grad_divisor
        self._mark_inconsistent = mark_inconsistent

    @property
    def _plan(self) -> OffloadPlan:
        """The layout's plan (a move to the host replaces it: [Note: moving the tail to the host])."""
        return self.layout.plan

    # -- training thread: the step's context -------------------------------------------------------------
    def begin_step(self) -> StepContext:
        """The current step's context, opened by the step's first flush (or by ``step()`` if nothing flushed)."""
        if self.ctx is None:
            self._worker.raise_if_failed()
            if self._gatherer is not None:  # the last step's all-gathers precede this step's reduce-scatters
                self._gatherer.drain(self._timeout_s)
            self.layout.grad_stats.zero_()
            speculative = self._plan.speculation and self._governor.speculate_next()
            # [Note: speculation and rollback]: a step that speculates nothing is never undone, so with the plan's
            # consent it updates the committed copy in place (less host traffic than writing the other copy)
            in_place = not speculative and self._plan.nonspeculative_in_place
            cur = self.layout.cur
            dst = cur if in_place else (cur + 1) % self.layout.copies
            in_place = speculative and dst == cur
            deferred = in_place and self._plan.deferred_speculation
            self.ctx = StepContext(speculative=speculative, spec_hypers=self._hypers_fn(),
                                   max_grad_norm=self._max_grad_norm_fn(), src=cur, dst=dst,
                                   one_path=in_place and not deferred, bf16_only=deferred,
                                   threads=self._plan.cpu_threads)
        return self.ctx

    def publish(self, ctx: StepContext, verdict: Verdict) -> list[tuple[HostBucket, bool]]:
        """Publish ``verdict`` to the step's tasks; returns the buckets still to finish, in need order, each with
        whether it speculated. Raises if a CPU task of the step failed before the verdict (nothing published)."""
        with self.lock:
            failed = ctx.failed
            if not failed:
                ctx.verdict_at = time.perf_counter()
                ctx.verdict = verdict
            pending = [(b, b.state is BucketState.SPECULATED) for b in self.layout.host_buckets
                       if b.state in (BucketState.SPECULATED, BucketState.DEFERRED)]
            # before the verdict a RUNNING bucket is being stepped speculatively; an OFFLOADED one is not reached yet
            speculated = sum(b.state in (BucketState.SPECULATED, BucketState.RUNNING) for b in self.layout.host_buckets)
            unreached = [b for b in self.layout.host_buckets if b.state is BucketState.OFFLOADED]
        if failed:  # wait until the worker records the failure, then raise it
            with contextlib.suppress(TimeoutError):
                self._worker.drain(self._timeout_s)
            self._worker.raise_if_failed()
            raise RuntimeError("hf_superoffload: a CPU task of this step failed")  # not reached: the worker failed
        self._telemetry.add(speculated_buckets=speculated,
                            wasted_buckets=self._wasted(ctx, verdict, speculated, unreached))
        pending.sort(key=lambda e: self.layout.need_order(e[0]))  # the worker may start on the first one early
        return pending

    def _wasted(self, ctx: StepContext, verdict: Verdict, speculated: int, unreached: list[HostBucket]) -> int:
        """``StepStats.wasted_buckets`` of this step, known when its verdict is published: every bucket stepped
        before a REDO or SKIP verdict, and under [Note: one path per bucket] every unreached bucket with a finite
        gradient (the worker steps it speculatively too, then undoes it). Counted here, not as the worker undoes,
        so the step's own StepStats holds each bucket once, whatever the timing."""
        if verdict.kind is StepVerdict.COMMIT:
            return 0  # decide(): the speculative hyper-parameters and scale are the verdict's, so every step stands
        if not (ctx.one_path and unreached):
            return speculated
        return speculated + sum(self._finite(unreached))

    def _finite(self, buckets: list[HostBucket]) -> list[bool]:
        """Whether each bucket's gradient is finite, as its first CPU task will find (one device read: only a
        speculative in-place step that clips or skips asks, for the buckets the worker has not reached)."""
        plain = [b.index for b in buckets if not b.accumulated]
        counts = self.layout.grad_stats[plain, :, 1].sum(dim=1).tolist() if plain else []
        nonfinite = dict(zip(plain, counts, strict=True))
        assert self._accum is not None or len(plain) == len(buckets)
        return [(self._accum.stats(b)[1] if b.accumulated else nonfinite[b.index]) == 0  # type: ignore[union-attr]
                for b in buckets]

    def queue_finishes(self, ctx: StepContext, verdict: Verdict, pending: list[tuple[HostBucket, bool]]) -> None:
        """Queue each pending bucket's ``finish_task`` (``pending`` from :meth:`publish`)."""
        if self._plan.d2h_lead_buckets:  # first tasks still waiting: the next forward's need order from now on
            self._worker.reprioritize(lambda b: self.layout.need_order(b) if isinstance(b, HostBucket) else None)
        for b, speculated in pending:
            self._worker.submit(self.layout.need_order(b), f"finishing {b.describe()}",
                                lambda b=b, s=speculated: self.finish_task(b, ctx, verdict, s))

    def end_step(self, verdict: Verdict) -> PassRecord | None:
        """Close the step in progress; returns the previous validated step's whole pass (``None`` if it had not
        finished)."""
        ctx, self.ctx = self.ctx, None
        with self.lock:
            prev, self._pass_ctx = self._pass_ctx, (ctx if verdict.kind is not StepVerdict.SKIP else None)
            if prev is None or prev.pass_done_at is None:
                return None
            assert prev.verdict is not None
            return PassRecord(wall_s=prev.pass_done_at - prev.verdict_at, adam_s=prev.adam_s,
                              clipped=prev.verdict.kind is StepVerdict.REDO, undid=prev.redone > 0,
                              threads=prev.threads)

    # -- CPU worker: a bucket's tasks ------------------------------------------------------------------
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
        finite = nonfinite_count == 0
        with self.lock:
            verdict = ctx.verdict
            if verdict is None:
                ctx.saw_nonfinite |= not finite
                ctx.partial_sumsq += sumsq / self._div**2
                if ctx.max_grad_norm and math.sqrt(ctx.partial_sumsq) + 1e-6 > ctx.max_grad_norm:
                    ctx.clip_certain = True
                # [Note: one path per bucket]: in place, what the rest of the step has shown changes nothing
                hold = not finite if ctx.one_path else not ctx.speculative or ctx.saw_nonfinite or ctx.clip_certain
                if hold:
                    b.to_deferred()
                    return
            b.to_running()
        if verdict is not None:
            # [Note: one path per bucket]: the speculative step the worker came too late for, then undone like one
            speculate = ctx.one_path and finite and verdict.kind is not StepVerdict.COMMIT
            if speculate:
                self._cpu_step(b, ctx, ctx.spec_hypers, 1.0 / self._div)
            self._finish(b, ctx, verdict, speculated=speculate)
            return
        self._cpu_step(b, ctx, ctx.spec_hypers, 1.0 / self._div, store_moments=not ctx.bf16_only,
                       store_master=not ctx.bf16_only)
        with self.lock:
            verdict = ctx.verdict
            if verdict is None:
                b.to_speculated()
                return
        self._finish(b, ctx, verdict, speculated=True)

    def abort(self) -> None:
        """Drop the step in progress. Before its verdict: finish it as SKIP, speculative updates are undone; after
        (``step()`` failed once it had queued the buckets): let them finish with it, undo nothing.

        If the worker itself failed, the undo runs here, in the calling thread. A bucket whose CPU step raised
        part-way (state RUNNING) cannot be restored and is named in the log.
        """
        ctx, self.ctx = self.ctx, None
        assert ctx is not None
        if ctx.verdict is not None:  # step() marked the engine inconsistent unless the verdict was SKIP
            with contextlib.suppress(BaseException):
                self._worker.drain(self._timeout_s)
            return
        self._undo_unpublished(ctx)
        if self._accum is not None and not self._worker.failed:
            self._worker.drain(self._timeout_s)  # accumulation adds still in flight

    def _undo_unpublished(self, ctx: StepContext) -> None:
        skip = Verdict(StepVerdict.SKIP, 1.0, ctx.spec_hypers, float("nan"))
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
                if ctx.dst == ctx.src and not ctx.bf16_only:
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
        if verdict.kind is StepVerdict.SKIP:
            if speculated:
                self._undo(b, ctx)
            with self.lock:
                b.to_idle_skipped()
            self._uploads.forget(b)
            return
        if not (speculated and b.applied == (verdict.hypers, verdict.grad_scale)):
            ctx.redone += speculated
            if speculated and not ctx.bf16_only:  # deferred speculation left p, m, v as they were: nothing to undo
                self._undo(b, ctx)
            # the verdict is known: with deferred moments this pass stores p and the bf16 weights only (with
            # deferred master stores the bf16 weights only)
            defer, late_master = self._commits.defers(b)
            self._cpu_step(b, ctx, verdict.hypers, verdict.grad_scale, store_moments=not defer,
                           store_master=not late_master)
            if defer:
                self._owe(b, ctx, verdict, master=late_master)
        elif ctx.bf16_only:  # [Note: deferred speculation]: the step stands; its commit is the whole step
            self._owe(b, ctx, verdict, master=True)
        if ctx.dst != ctx.src:  # parameters without a gradient keep their state in the new copy too
            for start, end in b.gaps:
                for d, s_ in zip(b.pmv[ctx.dst], b.pmv[ctx.src]):
                    d[start:end].copy_(s_[start:end])
        self._uploads.hand_over(b, ctx.dst)
        with self.lock:  # StepStats.pass_s: the worker has handed over this step's last host bucket
            ctx.finished += 1
            if ctx.finished == len(self.layout.host_buckets):
                ctx.pass_done_at = time.perf_counter()

    def _owe(self, b: HostBucket, ctx: StepContext, verdict: Verdict, *, master: bool) -> None:
        """Record the stores ``b``'s pass of this step left to the commit (``master``: p too, i.e. the whole step
        again on the pre-step state)."""
        assert self._commits.enabled, "a deferred store needs the second landing arena of deferred moments"
        if not b.runs:
            return
        record = MomentCommit(runs=b.runs, hypers=verdict.hypers, grad_scale=verdict.grad_scale, src=ctx.src,
                              dst=ctx.dst, grad=b.grad, master=master)
        with b.commit_lock:
            assert b.pending is None, "a moment commit was still pending when its bucket stepped again"
            b.pending = record

    def _cpu_step(self, b: HostBucket, ctx: StepContext, hypers: GroupHypers, scale: float, *,
                  store_moments: bool = True, store_master: bool = True) -> None:
        """AdamW on ``b``'s stepped slices: read state copy ``ctx.src``, write ``ctx.dst`` (the same in place).

        ``store_moments=False``: p and staging only; the caller records the :class:`MomentCommit` that stores m/v
        (``store_master=False`` as well: staging only, the commit stores p too).
        """
        t0 = time.perf_counter()
        (p_src, m_src, v_src), (p, m, v) = b.pmv[ctx.src], b.pmv[ctx.dst]
        with torch.profiler.record_function("superoffload::cpu_adam"):
            for r in b.runs:
                sl = slice(r.start, r.end)
                ops.cpu_adamw_step_(
                    p[sl], b.grad[sl], m[sl], v[sl], step=r.step, hyper=hypers[r.group], grad_scale=scale,
                    param_bf16_out=b.staging[sl] if b.staging is not None else None,
                    source=(p_src[sl], m_src[sl], v_src[sl]) if ctx.dst != ctx.src else None,
                    num_threads=ctx.threads, store_moments=store_moments, store_master=store_master,
                )
        b.applied = (hypers, scale)
        self._count_adam(ctx, t0)

    def _undo(self, b: HostBucket, ctx: StepContext) -> None:
        """Take back a speculative step. Double buffer and deferred speculation: the source copy is intact, only
        staging is refreshed; else the algebraic inverse in place."""
        assert b.applied is not None
        hypers, scale = b.applied
        t0 = time.perf_counter()
        p, m, v = b.pmv[ctx.src]
        with torch.profiler.record_function("superoffload::undo"):
            for r in b.runs:
                sl = slice(r.start, r.end)
                if ctx.dst == ctx.src and not ctx.bf16_only:
                    ops.cpu_adamw_undo_(
                        p[sl], b.grad[sl], m[sl], v[sl], step=r.step, hyper=hypers[r.group], grad_scale=scale,
                        param_bf16_out=None, num_threads=ctx.threads,
                    )
                if b.staging is not None:
                    b.staging[sl].copy_(p[sl])
        b.applied = None
        self._count_adam(ctx, t0)

    def _count_adam(self, ctx: StepContext, t0: float) -> None:
        """The seconds since ``t0`` go to this step's pass (``PassRecord.adam_s``) and the iteration's ``cpu_s``."""
        seconds = time.perf_counter() - t0
        ctx.adam_s += seconds
        self._telemetry.add(cpu_s=seconds)
