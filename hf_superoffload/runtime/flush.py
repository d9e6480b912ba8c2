"""The bucket pipeline of the backward: gradients counted per bucket, flattened with their statistics and
offloaded to the host once the bucket is complete.

On the last micro-batch of an accumulation (``sync``) a complete bucket is *flushed*: its gradients are
flattened on the compute stream together with their statistics (sum of squares, non-finite count), copied to
the page-locked landing buffer on the D2H stream, and released; a host bucket's first CPU task is queued, a
device (tail) bucket keeps its flat gradient on the device. With host accumulation ([Note: host accumulation])
host buckets are offloaded in every micro-batch and summed by the CPU worker. [Note: D2H lead] and
[Note: D2H gate] in docs/design.md say how many copies may stay in flight and when the CPU task is queued.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch

from ..planning.plan import OffloadPlan
from ..triton_kernels import flatten_grads_with_stats_
from .accumulation import HostAccumulator
from .bucket import DeviceBucket, HostBucket
from .cpu_worker import CpuWorker
from .host_pass import HostPass, StepContext
from .layout import BucketLayout
from .sharding import Sharding
from .streams import Handoff, StreamSet
from .telemetry import Telemetry
from .upload import Uploads

__all__ = ["GradFlush"]


class GradFlush:
    """Owns the arrival bookkeeping of one step and the D2H copies of the gradients.

    Attributes:
        arrived: per bucket, the parameters whose gradient has arrived in this step (or micro-batch).
        flushed: per bucket, whether it was flushed in this step.
        present: per bucket, the sum of ``index + 1`` of its parameters that got a gradient (data parallel: every
            rank must agree).
    """

    layout: BucketLayout
    arrived: list[set[int]]
    flushed: list[bool]
    present: list[int]
    _d2h_in_flight: collections.deque[Handoff]
    """Host buckets' gradient copies issued by the backward and not waited for yet ([Note: D2H lead])."""
    _streams: StreamSet
    _param_group: list[int]
    _param_steps: Callable[[], Sequence[int]]
    _worker: CpuWorker
    _telemetry: Telemetry
    _uploads: Uploads
    _host_pass: HostPass
    _accum: HostAccumulator | None
    _sharding: Sharding | None
    _begin_step: Callable[[], StepContext]
    _abort: Callable[[], None]

    def __init__(self, *, plan: OffloadPlan, layout: BucketLayout, streams: StreamSet, param_group: Sequence[int],
                 param_steps: Callable[[], Sequence[int]], worker: CpuWorker, telemetry: Telemetry,
                 uploads: Uploads, host_pass: HostPass, accum: HostAccumulator | None, sharding: Sharding | None,
                 begin_step: Callable[[], StepContext], abort: Callable[[], None]) -> None:
        """
        Args:
            param_steps: reads the live per-parameter step counts (a loaded state replaces them).
            begin_step: the current step's context (the first flush of a step opens it).
            abort: drops the step in progress after a flush failed.
        """
        self.layout, self._streams = layout, streams
        self._param_group, self._param_steps = list(param_group), param_steps
        self._worker, self._telemetry, self._uploads, self._host_pass = worker, telemetry, uploads, host_pass
        self._accum, self._sharding = accum, sharding
        self._begin_step, self._abort = begin_step, abort
        self._d2h_in_flight = collections.deque()
        self.arrived, self.flushed, self.present = [], [], []
        self.reset()

    @property
    def _plan(self) -> OffloadPlan:
        """The layout's plan (a move to the host replaces it: [Note: moving the tail to the host])."""
        return self.layout.plan

    def flush_rest(self) -> None:
        """Flush every bucket not flushed yet in this step (``step()``: parameters that received no gradient)."""
        for b in self.layout.buckets:
            if not self.flushed[b.index]:
                self.flush(b)

    def reset(self) -> None:
        """A new optimizer step: no bucket has gradients yet (no accumulation add may be in flight)."""
        n = len(self.layout.buckets)
        self.arrived = [set() for _ in range(n)]
        self.flushed = [False] * n
        self.present = [0] * n
        if self._accum is not None:
            self._accum.reset()

    def release_lead(self) -> None:
        """The backward is over: nothing left to hold back (the worker waits per copy)."""
        self._d2h_in_flight.clear()

    def on_grad(self, i: int, *, sync: bool) -> None:
        """Parameter ``i``'s gradient has accumulated; ``sync``: this backward ends an accumulation."""
        b = self.layout.bucket_of[i]
        if not sync and (self._accum is None or isinstance(b, DeviceBucket)):
            return  # accumulates in param.grad on the device
        if self.flushed[b.index]:
            raise RuntimeError(
                f"parameter {i} received a gradient after its bucket was offloaded in this step. "
                "For gradient accumulation, run the non-final micro-batches inside `with optimizer.no_sync():` "
                "(SuperOffloadTrainer and prepare_superoffload do this for you; a plain Trainer or accelerator.prepare "
                "does not: use those); call optimizer.step() before the next backward."
            )
        arrived = self.arrived[b.index]
        if i in arrived:
            return  # host accumulation: a gradient that grew on the device while its bucket waited for the rest
        arrived.add(i)
        self.present[b.index] += i + 1
        if len(arrived) == len(b.params):
            try:
                if sync:
                    self.flush(b)
                else:
                    self._accumulate(b)  # type: ignore[arg-type]
            except BaseException:
                self._abort()
                raise

    def flush(self, b: HostBucket | DeviceBucket) -> None:
        """Offload ``b``'s gradients for this step's update (``step()`` flushes the buckets that never completed)."""
        ctx = self._begin_step()
        self.flushed[b.index] = True
        grads = [p.grad for p in b.params]
        has = [g is not None for g in grads]
        summed = self._accum.summed(b) if self._accum is not None and isinstance(b, HostBucket) else 0
        if summed:
            has = [x or y for x, y in zip(has, self._accum.has(b), strict=True)]  # type: ignore[union-attr, arg-type]
        steps = self._param_steps()
        b.bucket_runs = b.plan_runs(has, [self._param_group[i] for i in b.spec.param_indices],
                                    [steps[i] for i in b.spec.param_indices])
        runs = b.clip_runs(b.bucket_runs)  # this rank's shard
        stats_row = self.layout.grad_stats[b.index]
        with torch.profiler.record_function("superoffload::flush"):
            if isinstance(b, DeviceBucket) and self._sharding is not None:
                b.grad, b.runs = self._sharding.flush_device(b, grads, stats_row), runs
            elif isinstance(b, DeviceBucket):
                flat = torch.empty(b.spec.numel, dtype=self.layout.dtype, device=self.layout.device)
                flatten_grads_with_stats_(grads, b.sizes, flat, stats_row)
                b.grad, b.runs = flat, runs
            else:
                self._uploads.wait(b, mid_step=False, for_stream=False)  # last H2D must be done with staging/landing
                if summed:  # the statistics are those of the sum, computed by the worker's boundary add
                    assert self._accum is not None
                    dest, slot = self._accum.target(b)
                    d2h = self._offload_grads(b, grads, None, dest)
                    self._accum.submit(b, d2h, slot, [g is not None for g in grads], final=True)
                    b.grad = self._accum.grad(b)
                else:  # (host accumulation: the ring's slots bound the copies in flight)
                    d2h = self._offload_grads(b, grads, stats_row, b.next_landing())
                    b.grad = b.landing
                    self._limit_d2h_lead(d2h)
                b.accumulated = bool(summed)
                b.to_offloaded(runs, d2h)
                self._uploads.expect(b)
                self._telemetry.add(d2h_bytes=b.landing.numel() * b.landing.element_size())
                # [Note: D2H gate]: queued once the copy has landed (host accumulation's sum: by the boundary add)
                gate = d2h.wait_host if self._plan.d2h_gate and not summed else None
                host_pass = self._host_pass
                self._worker.submit(self._task_order(b), f"CPU Adam of {b.describe()}",
                                    lambda: host_pass.run(b, ctx), tag=b, gate=gate)
        for p in b.params:
            p.grad = None

    def step_stats(self) -> tuple[float, float]:
        """One process: this step's sum of squares and non-finite count (a host sync)."""
        sumsq, nonfinite = self.layout.grad_stats.view(-1, 2).sum(dim=0).tolist()
        if self._accum is not None:  # host-accumulated buckets: the sum's statistics, from the worker
            for b in self.layout.host_buckets:
                if b.accumulated:
                    s_, n_ = self._accum.stats(b)
                    sumsq, nonfinite = sumsq + s_, nonfinite + n_
        return sumsq, nonfinite

    def _accumulate(self, b: HostBucket) -> None:
        """Host accumulation, non-boundary micro-batch: offload ``b``'s gradients for the worker to add; free them."""
        assert self._accum is not None
        self._begin_step()
        self.arrived[b.index] = set()
        grads = [p.grad for p in b.params]
        with torch.profiler.record_function("superoffload::flush_accumulate"):
            self._uploads.wait(b, mid_step=False, for_stream=False)  # the last step is done with its landing and sum
            dest, slot = self._accum.target(b)
            d2h = self._offload_grads(b, grads, None, dest)
            self._accum.submit(b, d2h, slot, [g is not None for g in grads], final=False)
            self._telemetry.add(d2h_bytes=dest.numel() * dest.element_size())
        for p in b.params:
            p.grad = None

    def _offload_grads(self, b: HostBucket, grads: list[torch.Tensor | None], stats_row: torch.Tensor | None,
                       dest: torch.Tensor) -> Handoff:
        """Flatten ``b``'s gradients (adding their statistics to ``stats_row``, if any) and copy them into ``dest``
        (the landing buffer, or a host-accumulation ring slot)."""
        s = self._streams
        if self._sharding is not None:
            assert stats_row is not None and dest is b.landing
            return self._sharding.offload_shard(b, grads, stats_row)
        if not s.is_cuda:
            flatten_grads_with_stats_(grads, b.sizes, dest, stats_row)
            return Handoff(dest, None)
        device = self.layout.device
        compute = torch.cuda.current_stream(device)
        flat = torch.empty(b.spec.numel, dtype=dest.dtype, device=device)
        flatten_grads_with_stats_(grads, b.sizes, flat, stats_row)
        s.d2h.wait_stream(compute)
        if b.h2d_event is not None:  # the previous upload still reads staging/landing's neighbours
            s.d2h.wait_event(b.h2d_event)
        with torch.cuda.stream(s.d2h):
            dest.copy_(flat, non_blocking=True)
            if stats_row is not None:
                self.layout.grad_stats_host[b.index].copy_(stats_row, non_blocking=True)
            event = s.record(s.d2h)
        flat.record_stream(s.d2h)
        return Handoff(dest, event)

    def _task_order(self, b: HostBucket) -> int:
        """Priority of a bucket's first CPU task, queued by the backward ([Note: D2H lead]). With no lead its
        gradients are on the host when it is queued: the forward-need order. With a lead the newest bucket's copy
        may still be in flight: arrival order (the oldest copy is the likeliest done), ahead of every finishing
        task; ``step()`` puts the ones still waiting back in need order once the verdict is known."""
        if self._plan.d2h_lead_buckets == 0:
            return self.layout.need_order(b)
        return b.index - len(self.layout.buckets)

    def _limit_d2h_lead(self, d2h: Handoff) -> None:
        """The rate limiter of [Note: D2H lead]: at most ``plan.d2h_lead_buckets`` copies stay in flight past the
        backward; the hook waits for the oldest one beyond that (the GPU keeps the work queued behind it)."""
        if d2h.event is None:
            return
        self._d2h_in_flight.append(d2h)
        while len(self._d2h_in_flight) > self._plan.d2h_lead_buckets:
            self._d2h_in_flight.popleft().wait_host()
