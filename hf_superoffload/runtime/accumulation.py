"""Host-side gradient accumulation: each micro-batch's host-bucket gradients are summed on the host.

[Note: host accumulation] in docs/weight_flow.md. With ``HostAccumulation.FP32`` or ``LANDING`` the engine
offloads a host bucket as soon as its gradients are complete in *every* micro-batch (inside ``no_sync()`` too)
and frees them on the device; the CPU worker sums the micro-batches here:

* ``FP32``: every micro-batch lands in the bucket's landing buffer; the worker copies (first micro-batch) or adds
  it into an exact-size fp32 arena. The CPU Adam then steps from the fp32 sum.
* ``LANDING``: the first micro-batch lands in the landing buffer, which holds the running sum in its own dtype;
  later ones land in one of a few bucket-sized pinned ring slots and the worker adds them into landing (bf16:
  rounded after every add exactly as torch accumulates a bf16 ``.grad``). The CPU Adam reads landing as usual.

Each add is a worker task queued at priority -1 (before every CPU Adam task) that waits on the D2H event of
its own copy. The boundary micro-batch's add also computes the statistics (sum of squares, non-finite count) of
the *accumulated* gradient; ``step()`` and the speculative CPU Adam read them from here. A buffer is reused
only after the task reading it set its event: waits block on ``threading.Event``/``Condition``, never poll.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import ops
from ..planning.plan import HostAccumulation
from .bucket import HostBucket
from .cpu_worker import CpuWorker
from .host_memory import HostBuffer
from .streams import Handoff

__all__ = ["ADD_PRIORITY", "HostAccumulator"]

ADD_PRIORITY = -(2**61)
"""Worker priority of the adds: before any other task (a bucket's CPU Adam task waits for its boundary add)."""


@dataclass(eq=False, slots=True)
class _BucketSum:
    """One host bucket's accumulation in the current optimizer step.

    Attributes:
        total: where the sum lives (a view of the fp32 arena, or the bucket's landing buffer).
        summed: micro-batches submitted so far this step (training thread).
        has: per parameter, whether any micro-batch so far gave it a gradient (training thread).
        idle: set while no add of this bucket is in flight (its landing buffer may be written again).
        stats: (sum of squares, non-finite count) of the accumulated gradient, valid once ``stats_ready``.
    """

    total: torch.Tensor
    summed: int = 0
    has: list[bool] | None = None
    idle: threading.Event = field(default_factory=threading.Event)
    stats: tuple[float, int] = (0.0, 0)
    stats_ready: threading.Event = field(default_factory=threading.Event)


class HostAccumulator:
    """The accumulation buffers of one engine and the CPU tasks that sum into them."""

    def __init__(self, *, mode: HostAccumulation, buckets: Sequence[HostBucket], host_numel: int,
                 ring: Sequence[int], landing_dtype: torch.dtype, pin: bool, worker: CpuWorker, timeout_s: float,
                 num_threads: int) -> None:
        """``ring``: the plan's landing-ring slot sizes in elements (``OffloadPlan.landing_ring``, LANDING only)."""
        if mode is HostAccumulation.OFF:
            raise ValueError("HostAccumulator needs HostAccumulation.FP32 or LANDING")
        self.mode = mode
        self._worker = worker
        self._timeout = timeout_s
        self._threads = num_threads
        self._dtype, self._pin = landing_dtype, pin
        self.buffers: list[HostBuffer] = []
        self._ring: list[torch.Tensor] = []
        self._sums: dict[int, _BucketSum] = {}
        self._free: list[int] = []
        self._cond = threading.Condition()
        self._woken = False
        self.relayout(buckets, host_numel=host_numel, ring=ring)

    def relayout(self, buckets: Sequence[HostBucket], *, host_numel: int, ring: Sequence[int]) -> None:
        """Size the buffers for ``buckets`` (bound to the host arenas of a plan with ``host_numel`` host elements and
        the landing ring ``ring``) and start every bucket's sum afresh: at construction, and after a move of the
        device tail ([Note: moving the tail to the host] in runtime/tail_move.py), after :meth:`release`."""
        self.release()
        arena = None
        if self.mode is HostAccumulation.FP32:
            buf = HostBuffer(host_numel, torch.float32, pin=False, name="fp32 gradient accumulator")
            self.buffers.append(buf)
            arena = buf.tensor
        else:
            sizes = tuple(ring)
            buf = HostBuffer(sum(sizes), self._dtype, pin=self._pin, name="accumulation landing ring")
            self.buffers.append(buf)
            self._ring = list(buf.tensor.split(list(sizes))) if sizes else []
        for b in buckets:
            total = arena[b.spec.offset : b.spec.offset + b.spec.shard] if arena is not None else b.landing
            s = _BucketSum(total)
            s.idle.set()
            self._sums[b.index] = s
        with self._cond:
            self._free = list(range(len(self._ring)))

    def release(self) -> None:
        """Drop the buffers and the per-bucket sums (their views of the landing arena too), so that a move of the
        device tail regrows the host arenas without them; :meth:`relayout` allocates them again."""
        assert self.empty, "the accumulation buffers are resized between optimizer steps only"
        self.buffers, self._ring, self._sums = [], [], {}

    # ---------------------------------------------------------------------------------------------- queries
    @property
    def empty(self) -> bool:
        """No micro-batch of the current optimizer step has been submitted (a step boundary)."""
        return all(s.summed == 0 for s in self._sums.values())

    def summed(self, b: HostBucket) -> int:
        """Micro-batches of ``b`` submitted in this step (0: nothing accumulated, the plain path applies)."""
        return self._sums[b.index].summed

    def has(self, b: HostBucket) -> list[bool] | None:
        """Per parameter of ``b``: whether some micro-batch gave it a gradient (``None``: none submitted)."""
        return self._sums[b.index].has

    def grad(self, b: HostBucket) -> torch.Tensor:
        """The accumulated gradient the CPU Adam reads (valid after the boundary add)."""
        return self._sums[b.index].total

    def stats(self, b: HostBucket) -> tuple[float, int]:
        """(sum of squares, non-finite count) of ``b``'s accumulated gradient; blocks until the boundary add ran."""
        s = self._sums[b.index]
        self._wait(s.stats_ready, b, "the statistics of its accumulated gradient")
        return s.stats

    # ---------------------------------------------------------------------------------------------- training thread
    def target(self, b: HostBucket) -> tuple[torch.Tensor, int | None]:
        """Where this micro-batch's D2H of ``b`` goes, and the ring slot it holds (``None``: landing)."""
        s = self._sums[b.index]
        self._wait(s.idle, b, "the add of its previous micro-batch")  # landing may be read by that add
        if self.mode is HostAccumulation.FP32 or s.summed == 0:
            return b.landing, None
        with self._cond:
            ok = self._cond.wait_for(lambda: self._slot_for(b) is not None or self._woken, self._timeout)
            self._worker.raise_if_failed()
            slot = self._slot_for(b)
            if not ok or slot is None:
                raise TimeoutError(f"hf_superoffload: no accumulation ring slot was freed in {self._timeout:.0f}s "
                                   f"(worker alive: {self._worker.alive})")
            self._free.remove(slot)
        return self._ring[slot][: b.spec.shard], slot

    def _slot_for(self, b: HostBucket) -> int | None:
        """The smallest free ring slot that holds ``b``'s shard (slots are sized by the largest host shards)."""
        fits = [k for k in self._free if self._ring[k].numel() >= b.spec.shard]
        return min(fits, key=lambda k: self._ring[k].numel()) if fits else None

    def submit(self, b: HostBucket, d2h: Handoff, slot: int | None, has: list[bool], *, final: bool) -> None:
        """Queue the add of the micro-batch that ``d2h`` carries; ``final``: also its statistics (boundary)."""
        s = self._sums[b.index]
        first = s.summed == 0
        s.summed += 1
        s.has = has if s.has is None else [x or y for x, y in zip(s.has, has, strict=True)]
        s.idle.clear()
        if final:
            # cleared here, not in reset(): a CPU Adam task of the last step may read them after step() returned
            s.stats_ready.clear()
        self._worker.submit(ADD_PRIORITY, f"gradient accumulation of {b.describe()}",
                            lambda: self._add(b, s, d2h, slot, first=first, final=final))

    def reset(self) -> None:
        """A new optimizer step (no add may be in flight: the boundary statistics were read, or the worker drained).

        The statistics stay readable until the bucket's next boundary add is queued."""
        for s in self._sums.values():
            s.summed, s.has = 0, None
            s.idle.set()
        with self._cond:
            self._free = list(range(len(self._ring)))

    def wake_all(self) -> None:
        """The worker failed: release every waiter (each then raises the worker's error)."""
        for s in self._sums.values():
            s.idle.set()
            s.stats_ready.set()
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------------------- worker
    def _add(self, b: HostBucket, s: _BucketSum, d2h: Handoff, slot: int | None, *, first: bool, final: bool) -> None:
        d2h.wait_host()
        src = d2h.tensor
        with torch.profiler.record_function("superoffload::accumulate"):
            if src is not s.total:  # LANDING's first micro-batch landed in the sum itself
                if first:
                    s.total.copy_(src)
                else:
                    s.total.add_(src)
            if final:
                s.stats = ops.grad_sumsq_nonfinite(s.total, num_threads=self._threads)
        if slot is not None:
            with self._cond:
                self._free.append(slot)
                self._cond.notify_all()
        s.idle.set()
        if final:
            s.stats_ready.set()

    def _wait(self, event: threading.Event, b: HostBucket, what: str) -> None:
        if not event.is_set():
            done = event.wait(self._timeout)
            self._worker.raise_if_failed()
            if not done:
                raise TimeoutError(f"hf_superoffload: {b.describe()} waited {self._timeout:.0f}s for {what} "
                                   f"(worker alive: {self._worker.alive}); raise SuperOffloadConfig.worker_timeout_s "
                                   "if the CPU is this slow, or report a bug")
        self._worker.raise_if_failed()
