"""The CPU worker's half of a host bucket's step: speculate or defer, finish for the verdict, undo, upload.

Mixed into ``OffloadEngine`` (it uses the engine's buckets, arenas, streams, lock and worker; the engine decides
when each runs: ``_run_host`` is queued when a bucket's gradients are offloaded, ``_finish_task`` after the
verdict). [Note: speculation and rollback], [Note: deferred moments] and [Note: stream ordering] in
docs/design.md say why it works this way.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import ops
from ..triton_kernels import scatter_flat_
from .bucket import HostBucket, MomentCommit
from .cpu_worker import WorkerError
from .master_deferral import COMMIT_BYTES
from .validation import Hyper, StepVerdict, Verdict

__all__ = ["HostStepMixin"]


def _released() -> None:
    """A gate that is already open: the task waits only for the gates queued before it."""


@dataclass(slots=True)
class _StepContext:
    """What the CPU tasks of one optimizer step share. Guarded by the engine lock."""

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


class HostStepMixin:
    """The worker-side steps of ``OffloadEngine`` for host buckets."""

    plan: Any
    streams: Any
    device: torch.device
    comm: Any
    _lock: threading.Lock
    _acc: Any
    _worker: Any
    _commit_clock: list[float]
    _commits_done_at: float | None
    defers_master: Any
    _uploader: Any
    _upload_seq: int

    def _run_host(self, b: HostBucket, ctx: _StepContext) -> None:
        try:
            self._run_host_unguarded(b, ctx)
        except BaseException:
            with self._lock:
                if ctx.verdict is None:
                    ctx.failed = True  # step() raises instead of validating: abort_step restores the state
                elif ctx.verdict.kind is not StepVerdict.SKIP:
                    self.consistent = False  # a validated step needed this bucket: it cannot be completed
            raise

    def _run_host_unguarded(self, b: HostBucket, ctx: _StepContext) -> None:
        assert b.d2h is not None
        self._commit_moments(b)  # the last step's deferred moments, before anything reads them (CPU idle: backward)
        b.d2h.wait_host()
        if b.accumulated:  # host accumulation: the boundary add (queued before this task) computed them
            assert self._accum is not None
            sumsq, nonfinite_count = self._accum.stats(b)
        else:
            sumsq, nonfinite_count = self._grad_stats_host[b.index].sum(dim=0).tolist()
        with self._lock:
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
        with self._lock:
            self._acc.speculated_buckets += 1
            verdict = ctx.verdict
            if verdict is None:
                b.to_speculated()
                return
        self._finish(b, ctx, verdict, speculated=True)

    def _finish(self, b: HostBucket, ctx: _StepContext, verdict: Verdict, *, speculated: bool) -> None:
        """Bring a RUNNING bucket to its final state for ``verdict``."""
        try:
            self._finish_unguarded(b, ctx, verdict, speculated=speculated)
        except BaseException:
            if verdict.kind is not StepVerdict.SKIP:
                self.consistent = False  # a validated step is half applied: refuse to checkpoint it
            raise

    def _finish_unguarded(self, b: HostBucket, ctx: _StepContext, verdict: Verdict, *, speculated: bool) -> None:
        if speculated and not (verdict.kind is StepVerdict.COMMIT and b.applied == (verdict.hyper, verdict.grad_scale)):
            with self._lock:
                self._acc.wasted_buckets += 1
        if verdict.kind is StepVerdict.SKIP:
            if speculated:
                self._undo(b, ctx)
            with self._lock:
                b.to_idle_skipped()
            self._unwaited.discard(b.index)
            return
        if not (speculated and b.applied == (verdict.hyper, verdict.grad_scale)):
            if speculated:
                self._undo(b, ctx)
            # the verdict is known: with deferred moments this pass stores p and the bf16 weights only (with
            # deferred master stores the bf16 weights only)
            late_master = self.defers_master(b)
            self._cpu_step(b, ctx, verdict.hyper, verdict.grad_scale, store_moments=not self._defer,
                           store_master=not late_master)
            if self._defer and b.runs:
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
        uploader = self._uploader
        if uploader is not None and not uploader.failed and threading.current_thread() is self._worker.thread:
            # [Note: upload thread]: the worker goes on to the next bucket's Adam; FIFO keeps the finishing order
            self._upload_seq += 1
            uploader.submit(self._upload_seq, f"upload of {b.describe()}", lambda: self._upload_task(b, ctx.dst))
        else:
            self._upload(b, ctx.dst)
        with self._lock:  # StepStats.pass_s: the worker has handed over this step's last host bucket
            ctx.finished += 1
            if ctx.finished == len(self.host_buckets):
                ctx.pass_done_at = time.perf_counter()

    def _upload_task(self, b: HostBucket, copy: int) -> None:
        """The upload thread's task: a failure leaves a validated step's weights unfinished on the device."""
        try:
            self._upload(b, copy)
        except BaseException:
            self.consistent = False
            raise

    def _finish_task(self, b: HostBucket, ctx: _StepContext, verdict: Verdict, speculated: bool) -> None:
        with self._lock:
            b.to_running()
        self._finish(b, ctx, verdict, speculated=speculated)

    def _cpu_step(self, b: HostBucket, ctx: _StepContext, hyper: Hyper, scale: float, *,
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
                    num_threads=self.plan.cpu_threads, store_moments=store_moments, store_master=store_master,
                )
        b.applied = (hyper, scale)
        with self._lock:
            self._acc.cpu_s += time.perf_counter() - t0

    def _commit_moments(self, b: HostBucket) -> None:
        """Store the moments a deferred step of ``b`` still owes, if any ([Note: deferred moments]). Any thread;
        ``b.commit_lock`` makes it happen once and makes a concurrent caller wait until it is done.

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
                    for k, (r, (beta1, beta2)) in enumerate(zip(c.runs, c.betas, strict=True)):
                        sl = slice(r.start, r.end)
                        if c.master is not None:  # the whole step again, bit for bit, without the bf16 copy
                            lr, eps, wd = c.master[k]
                            ops.cpu_adamw_step_(
                                p[sl], c.grad[sl], m[sl], v[sl], step=r.step, lr=lr, beta1=beta1, beta2=beta2,
                                eps=eps, weight_decay=wd, grad_scale=c.grad_scale,
                                source=(p_src[sl], m_src[sl], v_src[sl]) if c.dst != c.src else None,
                                num_threads=self.plan.cpu_threads,
                            )
                            continue
                        ops.cpu_adamw_moments_(
                            c.grad[sl], m[sl], v[sl], beta1=beta1, beta2=beta2, grad_scale=c.grad_scale,
                            source=(m_src[sl], v_src[sl]) if c.dst != c.src else None,
                            num_threads=self.plan.cpu_threads,
                        )
            except BaseException:
                if c.dst == c.src:
                    self.consistent = False
                raise
            b.pending = None
        seconds = time.perf_counter() - t0
        with self._lock:
            self._acc.commit_s += seconds
            self._commit_clock[0] += seconds
            self._commit_clock[1] += b.spec.shard * COMMIT_BYTES[c.master is not None]

    def _queue_idle_commits(self, k: int = 0) -> None:
        """Store the pending moments of host buckets ``k``, ``k + 1``, ... one task at a time, at the lowest worker
        priority (after every finishing task and every task of the next backward), in the next backward's arrival
        order. Each task queues the next: ``step()`` submits one task, and a more urgent task never waits for more
        than one bucket's commit. A failed worker: its error reaches the training thread at its next interaction."""
        buckets = self.host_buckets
        if k >= len(buckets):
            return
        b = buckets[k]
        if k == 0:
            with self._lock:
                self._commits_done_at = None

        def task() -> None:
            self._commit_moments(b)
            if k + 1 == len(buckets):
                with self._lock:  # [Note: adaptive master deferral]: the slack before the next verdict
                    self._commits_done_at = time.perf_counter()
            self._queue_idle_commits(k + 1)

        # [Note: D2H gate]: the chain enters the queue behind every gated first task of this step (the gates run
        # in submission order), so those run first and the chain finds their pending moments
        gate = _released if k == 0 and self.plan.d2h_gate else None
        with contextlib.suppress(WorkerError):
            self._worker.submit(len(self.buckets) + k, f"idle moment commit of {b.describe()}", task, gate=gate)

    def commit_moments(self) -> None:
        """Store every pending deferred moment (training thread): readers of the host state call it
        (:meth:`flat_state` does). Between steps it first waits for the worker's queued tasks, which may record
        commits; the worker itself commits them when idle, at the latest at the bucket's next CPU task."""
        if not self._defer:
            return
        if not self.step_in_progress and not self._worker.failed:
            self._worker.drain(self.timeout_s)
        for b in self.host_buckets:
            self._commit_moments(b)

    def drop_pending_moments(self) -> None:
        """Forget the pending moment commits: a loaded state replaces the moments they would store."""
        if not self._defer:
            return
        if not self.step_in_progress and not self._worker.failed:
            self._worker.drain(self.timeout_s)
        for b in self.host_buckets:
            with b.commit_lock:
                b.pending = None

    @property
    def pending_moment_commits(self) -> int:
        """Host buckets whose deferred moments are not stored yet."""
        return sum(b.pending is not None for b in self.host_buckets)

    def _undo(self, b: HostBucket, ctx: _StepContext) -> None:
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
                        param_bf16_out=None, num_threads=self.plan.cpu_threads,
                    )
                if b.staging is not None:
                    b.staging[sl].copy_(p[sl])
        b.applied = None
        with self._lock:
            self._acc.cpu_s += time.perf_counter() - t0

    def _upload(self, b: HostBucket, copy: int) -> None:
        if self._flow is not None and self.comm is None:  # weight flow: staging is the weights' home
            with self._lock:
                b.to_uploaded(None)
            return
        s = self.streams
        source = b.staging if b.staging is not None else b.pmv[copy][0]  # GPU cast: the fp32 master itself
        sharded = self.comm is not None  # data parallel: only this rank's shard goes up; the gatherer assembles
        with torch.profiler.record_function("superoffload::upload"):
            if not s.is_cuda:
                on_device, event = source, None
                if not sharded:
                    scatter_flat_(source, b.params)
            else:
                with torch.cuda.stream(s.h2d):
                    assert b.d2h is not None
                    b.d2h.wait_stream(s.h2d)
                    on_device = torch.empty(source.numel(), dtype=source.dtype, device=self.device)
                    on_device.copy_(source, non_blocking=True)
                    if not sharded:
                        scatter_flat_(on_device, b.params)
                    event = s.record(s.h2d)
            if sharded:
                b.gather_src = on_device
        with self._lock:
            self._acc.h2d_bytes += source.numel() * source.element_size()
            b.to_uploaded(event, final=not sharded)
