"""OffloadEngine: executes an :class:`OffloadPlan` for one set of parameters, as a coordinator over the stages
of the data flow ([Note: engine composition] in docs/design.md says which object owns what):

    plan (layout.py) -> hooks (hooks.py) -> buckets (flush.py) -> host pass (host_pass.py)
        -> commit (commit.py) -> upload (upload.py);  device tail (device_tail.py), data parallel (sharding.py)

Schedule of one optimizer step:

1. Backward. Each parameter's post-accumulate-grad hook counts towards its bucket; a complete bucket is flushed
   (``GradFlush``) and a host bucket's first CPU task is queued (``HostPass.run``), which may step AdamW
   speculatively as soon as that bucket's D2H copy has landed.
2. ``step()`` flushes the buckets that did not complete (parameters without gradients), reads the global norm
   and non-finite count (the one host sync of the step), and decides COMMIT / REDO / SKIP
   ([Note: speculation and rollback]). It publishes the verdict and queues each pending host bucket's finish.
3. The device tail steps on the compute stream; host buckets, once final, are uploaded (``Uploads``) and their
   ``ready`` flag and H2D event release the next forward of the layers that own them ([Note: stream ordering]).
   With ``plan.defer_moments`` a verdict-known pass leaves the moments to ``MomentCommits``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .. import ops
from ..planning.plan import HostAccumulation, OffloadPlan, Placement, WeightMode
from . import registry
from .accumulation import HostAccumulator
from .bucket import DeviceBucket, HostBucket
from .collectives import ShardGroup
from .commit import MomentCommits
from .cpu_worker import CpuWorker
from .device_tail import step_device_tail
from .flush import GradFlush
from .hooks import Hooks
from .host_memory import HostBuffer
from .host_pass import HostPass
from .layout import BucketLayout, check_plan
from .registry import module_weights
from .sharding import Sharding
from .streams import StreamSet
from .tail_move import check_move, check_move_to_device, move_to_device, move_to_host
from .telemetry import StepStats, Telemetry
from .upload import Uploads
from .validation import GroupHypers, SpeculationGovernor, StepVerdict, decide
from .weight_flow import WeightStreamer

__all__ = ["OffloadEngine", "StepStats", "module_weights"]

logger = logging.getLogger("hf_superoffload")


class OffloadEngine:
    """Wires plan, buckets, hooks, streams and the CPU worker for one optimizer; owns the step's sequence."""

    params: list[torch.nn.Parameter]
    param_group: list[int]
    param_steps: list[int]
    governor: SpeculationGovernor
    comm: ShardGroup | None
    device: torch.device
    dtype: torch.dtype
    streams: StreamSet
    stats: StepStats
    consistent: bool
    """False once a worker failure left a validated step half applied (the state must not be saved)."""
    commit_when_idle: bool
    """``False``: deferred moments are stored only at the bucket's next CPU task or a reader's request, never when
    the worker is idle (white-box tests use it)."""
    sync_predicate: Callable[[], bool] | None
    max_grad_norm_fn: Callable[[], float | None]
    hypers_fn: Callable[[], GroupHypers]
    layout: BucketLayout
    telemetry: Telemetry
    sharding: Sharding | None
    uploads: Uploads
    commits: MomentCommits
    host_pass: HostPass
    flush: GradFlush
    hooks: Hooks
    _worker: CpuWorker
    _accum: HostAccumulator | None
    _flow: WeightStreamer | None
    _lock: threading.Lock
    """The bucket-state lock (see :class:`HostPass`)."""
    _div: float
    """Gradients are summed over the ranks and divided by this."""
    _no_sync_depth: int
    _closed: bool

    def __init__(self, *, params: Sequence[torch.nn.Parameter], param_group: Sequence[int],
                 hypers_fn: Callable[[], GroupHypers], plan: OffloadPlan, modules: Sequence[torch.nn.Module],
                 check_finite: bool, timeout_s: float, governor: SpeculationGovernor,
                 comm: ShardGroup | None = None) -> None:
        """
        Args:
            params: trainable parameters, deduplicated, in gradient-arrival order (plan indices refer to it).
            param_group: the optimizer param group of each parameter.
            hypers_fn: reads the live per-group hyper-parameters (LR schedulers change them).
            modules: modules whose forward must wait for their parameters (every module of the model).
            comm: data parallelism: the group the optimizer state is sharded over ([Note: data parallel
                sharding]); the plan's ``world_size``/``rank`` must match it.
        """
        self.params, self.param_group = list(params), list(param_group)
        self.param_steps = [0] * len(self.params)
        self.hypers_fn, self.check_finite, self.timeout_s = hypers_fn, check_finite, timeout_s
        self.governor, self.comm = governor, comm
        check_plan(plan, comm=comm)
        self._div = comm.grad_divisor if comm else 1.0
        self.device, self.dtype = self.params[0].device, self.params[0].dtype
        self.streams = StreamSet.create(self.device)  # every stream of the engine, created here once
        self._lock, self.stats, self.telemetry = threading.Lock(), StepStats(), Telemetry()
        self.sync_predicate, self.max_grad_norm_fn = None, lambda: None
        self._no_sync_depth, self._closed, self.consistent, self.commit_when_idle = 0, False, True, True

        registry.close_earlier(self.params)
        if plan.host_numel:
            # Build/load the CPU Adam library now, not inside the first step (a first JIT build takes ~15 s).
            logger.info("hf_superoffload: CPU Adam backend %s, %d threads", ops.backend(), plan.cpu_threads)

        # plan -> hooks -> buckets -> host pass -> commit -> upload: built in reverse, each given what it calls
        self.layout = layout = BucketLayout(plan=plan, params=self.params, is_cuda=self.streams.is_cuda,
                                            data_parallel=comm is not None)
        self._accum = None
        self._worker = CpuWorker(device=self.device, on_error=self._wake_all, affinity=plan.cpu_affinity,
                                 gated=plan.d2h_gate)
        if plan.host_accumulation is not HostAccumulation.OFF:
            self._accum = HostAccumulator(
                mode=plan.host_accumulation, buckets=layout.host_buckets, host_numel=plan.host_numel,
                ring=plan.landing_ring,
                landing_dtype=layout.arenas["landing"].tensor.dtype, pin=plan.pin_memory and self.streams.is_cuda,
                worker=self._worker, timeout_s=timeout_s, num_threads=plan.cpu_threads)
        self.sharding = (Sharding(comm=comm, layout=layout, streams=self.streams, lock=self._lock, timeout_s=timeout_s,
                                  raise_if_worker_failed=self._worker.raise_if_failed, on_error=self._wake_all)
                         if comm is not None else None)
        gatherer = self.sharding.gatherer if self.sharding else None
        flow = plan.weight_mode is WeightMode.FLOW
        self.uploads = Uploads(layout=layout, streams=self.streams, lock=self._lock, telemetry=self.telemetry,
                               worker=self._worker, gatherer=gatherer,
                               streamed=flow, upload_thread=plan.upload_thread, timeout_s=timeout_s,
                               mark_inconsistent=self._mark_inconsistent, on_error=self._wake_all)
        self.commits = MomentCommits(plan=plan, layout=layout, worker=self._worker, telemetry=self.telemetry,
                                     timeout_s=timeout_s, mark_inconsistent=self._mark_inconsistent)
        self.host_pass = HostPass(plan=plan, layout=layout, lock=self._lock, worker=self._worker,
                                  timeout_s=timeout_s, telemetry=self.telemetry,
                                  commits=self.commits, uploads=self.uploads, accum=self._accum,
                                  grad_divisor=self._div, mark_inconsistent=self._mark_inconsistent,
                                  governor=governor, hypers_fn=hypers_fn, gatherer=gatherer,
                                  max_grad_norm_fn=lambda: self.max_grad_norm_fn())
        self.flush = GradFlush(plan=plan, layout=layout, streams=self.streams, param_group=self.param_group,
                               param_steps=lambda: self.param_steps, worker=self._worker, telemetry=self.telemetry,
                               uploads=self.uploads, host_pass=self.host_pass, accum=self._accum,
                               sharding=self.sharding, begin_step=self.host_pass.begin_step, abort=self.abort_step)
        self.hooks = Hooks(layout=layout, modules=modules, uploads=self.uploads, on_grad=self._on_grad,
                           wait=self.wait_bucket, track_unhooked=not flow)
        # weight flow: the streamer's hooks own the weights (an unhooked read finds them released)
        self._flow = None if not flow else WeightStreamer(
            root=modules[0], sources=layout.weight_sources(), stream=self.streams.weights,
            staging_final=lambda b, block: self.uploads.staging_final(b, block=block, mid_step=self._mid_step()),
            on_h2d=lambda n: self.telemetry.add(h2d_bytes=n), synchronize=self.synchronize)
        layout.allocate_device_state()  # under weight flow: now that the streamed weights left the device
        registry.claim(self)

    @property
    def plan(self) -> OffloadPlan:
        """The plan the engine runs: its layout's (a move of the tail replaces it there)."""
        return self.layout.plan

    def amend_plan(self, plan: OffloadPlan) -> None:
        """Replace the plan by one that differs only in what the runtime does not read (the kept layers, which the
        optimizer applies to the model)."""
        if dataclasses.replace(plan, kept_layers=self.plan.kept_layers, notes=self.plan.notes) != self.plan:
            raise ValueError("amend_plan changes the kept layers only; the engine is built for the rest of its plan")
        self.layout.plan = plan

    def set_cpu_threads(self, threads: int) -> None:
        """Run the CPU Adam at ``threads`` from the next step on ([Note: the thread trial] in
        planning/thread_trial.py); the step in progress and the pass still running from the last one keep the count
        they opened with (``StepContext.threads``). The values do not depend on it."""
        if threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {threads}")
        self.layout.plan = dataclasses.replace(self.plan, cpu_threads=threads)

    @property
    def _movable(self) -> bool:
        """A quiet point of a tail that may move: one process, stationary weights, between steps (with host
        accumulation: before the step's first micro-batch, when nothing is summed on the host)."""
        return (self.comm is None and self._flow is None and not self.step_in_progress
                and (self._accum is None or self._accum.empty))

    @property
    def mid_accumulation(self) -> bool:
        """Host accumulation holds gradients of micro-batches of the current optimizer step: the tail cannot move
        until its ``step()`` ([Note: moving the tail to the host] in runtime/tail_move.py)."""
        return self._accum is not None and (self.step_in_progress or not self._accum.empty)

    @property
    def can_move_to_host(self) -> bool:
        """Whether :meth:`move_to_host` may run now: one process, stationary weights, between steps (with host
        accumulation: at a step's first micro-batch)."""
        return self._movable and self.plan.device_numel > 0

    @property
    def can_move_to_device(self) -> bool:
        """Whether :meth:`move_to_device` may run now: as :attr:`can_move_to_host`, with host buckets to move."""
        return self._movable and self.plan.host_numel > 0

    def _refuse_move(self, what: str) -> None:
        if self.mid_accumulation:
            raise RuntimeError(f"{what} at a step's first micro-batch, not while host accumulation holds the "
                               "gradients of earlier micro-batches of the step")
        raise RuntimeError(f"{what} between steps, in one process with stationary weights")

    def _release_accumulation(self) -> None:
        """Before a move: nothing is summed on the host, so the accumulation buffers go first (the host arenas then
        regrow without them, and no bucket's sum keeps an old landing arena alive)."""
        if self._accum is not None:
            self._accum.release()

    def _relayout_accumulation(self, plan: OffloadPlan) -> None:
        """After a move: the host accumulation's buffers at the new host share (the fp32 arena, or the landing ring
        sized by the largest host shards) and every host bucket's sum bound to them."""
        if self._accum is None:
            return
        self._accum.relayout(self.layout.host_buckets, host_numel=plan.host_numel, ring=plan.landing_ring)

    def _quiesce(self) -> None:
        """Before a move: every upload done, the device weights final, no deferred store pending (they read the
        arenas a move reallocates)."""
        self.synchronize()
        self.commit_moments()

    def move_to_host(self, plan: OffloadPlan) -> int:
        """Train on with ``plan``, which moves the first device buckets to the host ([Note: moving the tail to the
        host] in runtime/tail_move.py). At a quiet point only: no step in progress (the optimizer calls it in a
        training forward's pre-hook). Returns how many parameters moved."""
        if not self.can_move_to_host:
            self._refuse_move("the device tail moves to the host")
        check_move(self.plan, plan)  # before anything is released
        self._quiesce()
        if not self.plan.host_numel:
            logger.info("hf_superoffload: CPU Adam backend %s, %d threads", ops.backend(), plan.cpu_threads)
        self._release_accumulation()
        moved = move_to_host(self.layout, plan)
        self._relayout_accumulation(plan)
        if plan.d2h_gate:  # a larger host share may turn the gate on; the next backward's first tasks use it
            self._worker.enable_gate()
        self.hooks.relayout()
        self.commits.relayout()
        if plan.upload_thread:
            self.uploads.start_thread(self._wake_all)
        return sum(p.numel() for b in moved for p in b.params)

    def move_to_device(self, plan: OffloadPlan) -> int:
        """Train on with ``plan``, which moves the last host buckets to the device ([Note: moving the tail to the
        device] in runtime/tail_move.py). At the same quiet point as :meth:`move_to_host`. Returns how many
        parameters moved."""
        if not self.can_move_to_device:
            self._refuse_move("host buckets move to the device")
        check_move_to_device(self.plan, plan)  # before anything is released
        self._quiesce()
        self._release_accumulation()
        moved = move_to_device(self.layout, plan)
        self._relayout_accumulation(plan)
        for b in moved:
            self.uploads.unwaited.discard(b.index)  # synchronize() waited for them: a device bucket has no upload
        self.hooks.relayout()
        self.commits.relayout()
        return sum(p.numel() for b in moved for p in b.params)

    # -- the host buckets, as the integrations and tests read them ------------------------------------
    @property
    def host_buckets(self) -> list[HostBucket]:
        return self.layout.host_buckets

    @property
    def device_buckets(self) -> list[DeviceBucket]:
        return self.layout.device_buckets

    @property
    def pending_moment_commits(self) -> int:
        """Host buckets whose deferred moments are not stored yet."""
        return self.commits.pending

    @property
    def accumulation_buffers(self) -> list[HostBuffer]:
        """The host accumulation's buffers (the fp32 arena or the landing ring; none without host accumulation)."""
        return list(self._accum.buffers) if self._accum is not None else []

    @property
    def host_arena_numel(self) -> int:
        """Elements each host state arena holds ([Note: the host arenas keep their size] in runtime/tail_move.py)."""
        return self.layout.host_arena_numel

    @property
    def host_arena_capacity(self) -> int:
        """Elements every host state arena can grow to in place ([Note: reserved room in the host arenas] in
        runtime/tail_move.py)."""
        return self.layout.host_arena_capacity

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes: the layout's arenas and the host accumulation's buffers."""
        return self.layout.pinned_bytes + sum(b.nbytes for b in self.accumulation_buffers if b.pinned)

    @property
    def step_in_progress(self) -> bool:
        """Between the first offloaded gradient of a step and its ``step()``."""
        return self.host_pass.ctx is not None

    def _mark_inconsistent(self) -> None:
        self.consistent = False

    def _wake_all(self) -> None:
        """A helper thread failed: nothing waiting on a bucket may wait for it any longer."""
        if self._accum is not None:
            self._accum.wake_all()
        for b in self.layout.host_buckets:
            b.uploaded.set()
            b.ready.set()

    # -- backward --------------------------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside is not an accumulation boundary: gradients accumulate on the device (host buckets: on
        the host, with host accumulation) and nothing is stepped."""
        self.enter_no_sync()
        try:
            yield
        finally:
            self.exit_no_sync()

    def enter_no_sync(self, depth: int = 1) -> None:
        """Open ``depth`` accumulation blocks (the facade's ``no_sync`` may have opened one before the engine
        existed)."""
        self._no_sync_depth += depth

    def exit_no_sync(self) -> None:
        self._no_sync_depth -= 1

    def _on_grad(self, i: int) -> None:
        sync = not self._no_sync_depth and (self.sync_predicate() if self.sync_predicate is not None else True)
        self.flush.on_grad(i, sync=sync)

    # -- step ------------------------------------------------------------------------------------------
    def step(self, max_grad_norm: float | None) -> StepStats:
        """Validate this step's gradients and finish the update. Returns the step's telemetry."""
        self._worker.raise_if_failed()
        if self.uploads.thread is not None:
            self.uploads.thread.raise_if_failed()
        ctx = self.host_pass.begin_step()
        layout = self.layout
        self.flush.flush_rest()  # buckets with parameters that received no gradient
        with torch.profiler.record_function("superoffload::validate"):
            if self.sharding is None:
                sumsq, nonfinite = self.flush.step_stats()  # the one host sync of the step
            else:
                sumsq, nonfinite = self.sharding.global_stats(self.flush.present)
        verdict = decide(sumsq=sumsq, nonfinite=nonfinite > 0, max_grad_norm=max_grad_norm, hypers=self.hypers_fn(),
                         spec_hypers=ctx.spec_hypers, check_finite=self.check_finite, grad_divisor=self._div)
        if self.commits.adaptive and verdict.kind is not StepVerdict.SKIP:
            # before the verdict is published: a worker task that sees it finishes with this step's share
            self.commits.adapt_share()
        pending = self.host_pass.publish(ctx, verdict)  # raises if a CPU task of this step failed
        self.flush.release_lead()
        try:
            self.host_pass.queue_finishes(ctx, verdict, pending)
            step_device_tail(layout.device_buckets, verdict, self.sharding)
            if self.sharding is not None and verdict.kind is not StepVerdict.SKIP:
                self.sharding.queue_gathers()
        except BaseException:
            if verdict.kind is not StepVerdict.SKIP:
                self.consistent = False  # host buckets are being committed with this verdict: it cannot be undone
            raise
        if self.commits.enabled and self.commit_when_idle and verdict.kind is not StepVerdict.SKIP:
            self.commits.queue_idle()
        if verdict.kind is not StepVerdict.SKIP:
            self.layout.cur = ctx.dst  # the buckets still finishing write this copy; readers drain them first
            layout.advance_steps(self.param_steps)
        self.governor.record(speculated=ctx.speculative, verdict=verdict.kind)
        passed = self.host_pass.end_step(verdict)
        self.stats = self.telemetry.end_iteration(
            verdict=verdict, speculative=ctx.speculative, grad_divisor=self._div,
            master_deferred_buckets=self.commits.master_count if self.commits.enabled else 0,
            moment_deferred_buckets=self.commits.moment_count if self.commits.enabled else 0,
            host_pass=passed)
        self.flush.reset()
        self.hooks.learn_unhooked_reads()
        return self.stats

    def abort_step(self) -> None:
        """Drop a step in progress (after an error): speculative updates are undone, nothing is applied.

        If the worker itself failed, the undo runs here, in the calling thread (``HostPass.abort``).
        """
        if self.host_pass.ctx is None:
            return
        self.flush.release_lead()
        self.host_pass.abort()
        for b in self.layout.device_buckets:
            b.grad = None
        self.flush.reset()

    # -- training thread: waits ------------------------------------------------------------------------
    def _helpers(self) -> list[CpuWorker]:
        """The threads the CPU worker queues work for (drained after it)."""
        return [w for w in (self.sharding.gatherer if self.sharding else None, self.uploads.thread) if w is not None]

    def wait_bucket(self, b: HostBucket, *, for_stream: bool = True) -> None:
        """Block until ``b``'s parameters are final; then order the current stream after its upload (a forward
        in the middle of a step does not wait: the device still holds the previous, valid weights)."""
        self.uploads.wait(b, mid_step=self._mid_step(), for_stream=for_stream)

    def _mid_step(self) -> bool:
        """Gradients of this step were offloaded and its verdict is not known yet."""
        ctx = self.host_pass.ctx
        return ctx is not None and ctx.verdict is None

    def synchronize(self) -> None:
        """Wait until every bucket's parameters on the device are final (before saving or reading weights).

        In the middle of a step (before ``step()``) the device weights are the previous step's, already final.
        """
        if self.step_in_progress:
            return
        if self._worker.failed:
            if not self.consistent:
                self._worker.raise_if_failed()
            return  # abort_step undid the failed step in this thread: nothing is in flight or will be uploaded
        self._worker.drain(self.timeout_s)
        for helper in self._helpers():  # the worker queued them: drained after it
            helper.drain(self.timeout_s)
        for b in self.layout.host_buckets:
            self.wait_bucket(b)

    @contextmanager
    def module_weights(self, module: torch.nn.Module) -> Iterator[None]:
        """See the module-level :func:`module_weights`."""
        if self._flow is not None:
            with self._flow.using(module):
                yield
            return
        self.hooks.wait_for(module)
        yield

    @contextmanager
    def materialized(self) -> Iterator[None]:
        """Inside the block every parameter holds its final weights on the device (all modes)."""
        self.synchronize()
        if self._flow is None:
            yield
            return
        with self._flow.materialized():
            yield

    # -- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the last step (or undo one interrupted mid-backward), then stop the worker and remove hooks."""
        if self._closed:
            return
        try:
            if self.step_in_progress:
                self.abort_step()  # e.g. KeyboardInterrupt in backward: back to the state before that step
            elif not self._worker.failed:
                self._worker.drain(self.timeout_s)  # the last step's buckets are final before the worker stops
                for helper in self._helpers():
                    if not helper.failed:
                        helper.drain(self.timeout_s)
        finally:
            self._closed = True
            if self._flow is not None:  # the model keeps its final weights on the device
                try:
                    self._flow.close(materialize=self.consistent and not self._worker.failed)
                except BaseException:
                    logger.exception("hf_superoffload: could not bring the streamed weights back to the device")
            registry.release(self)
            self.hooks.remove()
            self._worker.close()
            for helper in self._helpers():
                helper.close()

    # -- state -----------------------------------------------------------------------------------------
    def param_location(self, i: int) -> tuple[Placement, int]:
        """(placement, element offset in that placement's arenas) of parameter ``i`` (one process only: with
        data parallelism a parameter may straddle shards, see :meth:`param_pieces`)."""
        if self.comm is not None:
            raise RuntimeError("param_location() is for a single process; use param_pieces() with data parallelism")
        return self.layout.param_location(i)

    def param_pieces(self, i: int) -> list[tuple[Placement, int, int, int]]:
        """See :meth:`BucketLayout.param_pieces`."""
        return self.layout.param_pieces(i)

    def flat_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live flat arenas: ``{"host": {...}, "device": {...}}`` with master, exp_avg, exp_avg_sq (pending
        deferred moments are stored first)."""
        self.commit_moments()
        return self.layout.flat_state()

    def commit_moments(self) -> None:
        """Store every pending deferred moment (training thread): readers of the host state call it."""
        self.commits.commit_all(step_in_progress=self.step_in_progress)

    def drop_pending_moments(self) -> None:
        """Forget the pending moment commits: a loaded state replaces the moments they would store."""
        self.commits.drop_pending(step_in_progress=self.step_in_progress)

    def seed_masters(self, values: Sequence[torch.Tensor | None]) -> None:
        """Overwrite the masters of parameters with exact values (fp32 models), then refresh the weights."""
        self.commit_moments()
        self.layout.seed_masters(values)
        self.refresh_params_from_masters()

    def refresh_params_from_masters(self) -> None:
        """After loading state: staging := bf16(master) and parameters := bf16(master).

        Data parallel: a collective (every rank's shards are gathered); every rank must call it.
        """
        self.layout.write_weights(gather=self.sharding.gather_master if self.sharding else None,
                                  streamed=self._flow is not None)
        if self._flow is not None:
            self._flow.release_all()  # the next use fetches the new staging
        if self.streams.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
