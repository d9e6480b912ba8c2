"""Data parallelism inside the engine: gradients reduce-scattered, shards stepped, weights all-gathered.

The mechanism half of [Note: data parallel sharding] in docs/design.md. Every collective goes through
:class:`~.collectives.ShardGroup` on the optimizer's private process group; :class:`Sharding` exists only when
the engine has one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..triton_kernels import flatten_grads_with_stats_, scatter_flat_, sumsq_nonfinite
from .bucket import DeviceBucket, HostBucket
from .collectives import ShardGroup
from .cpu_worker import CpuWorker
from .layout import BucketLayout
from .streams import Handoff, StreamSet

__all__ = ["Sharding", "add_stats_"]


def add_stats_(x: torch.Tensor, stats: torch.Tensor) -> None:
    """``stats``' column sums ``+= [sum of squares, non-finite count]`` of ``x`` as stored, into its first row
    (``stats`` is ``[2]`` or ``[rows, 2]``; no host sync), summed in a fixed order."""
    row = stats if stats.dim() == 1 else stats[0]
    row += sumsq_nonfinite(x)


class Sharding:
    """Owns the data-parallel collectives of one engine and the gatherer thread that issues the all-gathers.

    One thread issues the all-gathers, in need order, so every rank issues them alike; ``drain`` it before the
    next step's reduce-scatters.
    """

    comm: ShardGroup
    layout: BucketLayout
    streams: StreamSet
    device: torch.device
    dtype: torch.dtype
    gatherer: CpuWorker
    _lock: threading.Lock
    _raise_if_worker_failed: Callable[[], None]
    _timeout_s: float
    _seq: int

    def __init__(self, *, comm: ShardGroup, layout: BucketLayout, streams: StreamSet, lock: threading.Lock,
                 timeout_s: float, raise_if_worker_failed: Callable[[], None], on_error: Callable[[], None]) -> None:
        self.comm, self.layout, self.streams = comm, layout, streams
        self.device, self.dtype = layout.device, layout.dtype
        self._lock = lock
        self._timeout_s = timeout_s
        self._raise_if_worker_failed = raise_if_worker_failed
        self.gatherer = CpuWorker(device=self.device, on_error=on_error, name="superoffload-gather")
        self._seq = 0

    # -- backward ----------------------------------------------------------------------------------
    def reduce_scatter(self, b: HostBucket | DeviceBucket, grads: list[torch.Tensor | None], *,
                       async_op: bool) -> tuple[torch.Tensor, object, torch.Tensor] | torch.Tensor:
        """Flatten ``b``'s gradients into a padded bucket and reduce-scatter it: this rank's shard of the sum
        (asynchronous: with the work and the padded input, which must outlive the collective)."""
        spec = b.spec
        full = torch.empty(spec.shard * self.comm.world_size, dtype=self.dtype, device=self.device)
        flatten_grads_with_stats_(grads, b.sizes, full[: spec.numel], None)
        full[spec.numel :].zero_()
        shard = torch.empty(spec.shard, dtype=self.dtype, device=self.device)
        work = self.comm.reduce_scatter(shard, full, async_op=async_op)
        return (shard, work, full) if async_op else shard

    def flush_device(self, b: DeviceBucket, grads: list[torch.Tensor | None], stats_row: torch.Tensor) -> torch.Tensor:
        """A device-tail bucket: this rank's shard of the summed gradient (its statistics added to ``stats_row``)."""
        shard = self.reduce_scatter(b, grads, async_op=False)
        assert isinstance(shard, torch.Tensor)
        add_stats_(shard, stats_row)
        return shard

    def offload_shard(self, b: HostBucket, grads: list[torch.Tensor | None], stats_row: torch.Tensor) -> Handoff:
        """Reduce-scatter, then this rank's shard (and its statistics) goes to the host."""
        s = self.streams
        if not s.is_cuda:
            shard = self.reduce_scatter(b, grads, async_op=False)
            assert isinstance(shard, torch.Tensor)
            flatten_grads_with_stats_([shard], [b.spec.shard], b.landing, stats_row)
            return Handoff(b.landing, None)
        compute = torch.cuda.current_stream(self.device)
        shard, work, full = self.reduce_scatter(b, grads, async_op=True)  # type: ignore[misc]
        s.d2h.wait_stream(compute)
        if b.h2d_event is not None:
            s.d2h.wait_event(b.h2d_event)
        with torch.cuda.stream(s.d2h):
            work.wait()  # the D2H stream (not the host) waits for the reduce-scatter
            flat = torch.empty(b.spec.shard, dtype=b.landing.dtype, device=self.device)
            flatten_grads_with_stats_([shard], [b.spec.shard], flat, stats_row)  # the padding is zero
            b.landing.copy_(flat, non_blocking=True)
            self.layout.grad_stats_host[b.index].copy_(stats_row, non_blocking=True)
            event = s.record(s.d2h)
        # the compute stream's allocator must not hand these out again before the collective (which the D2H
        # stream waited for) is done with them
        for t in (full, shard, flat):
            t.record_stream(s.d2h)
        return Handoff(b.landing, event)

    # -- validation --------------------------------------------------------------------------------
    def global_stats(self, present: Sequence[int]) -> tuple[float, float]:
        """The step's sum of squares and non-finite count over every rank's shards.

        The same all-reduce checks that every rank got gradients for the same parameters (``present``: per
        bucket, the sum of ``index + 1`` of its parameters that got one): a parameter used on some ranks only
        would step on some shards only and the replicas would drift apart.
        """
        if self.streams.is_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)  # host buckets' rows land there
        key = torch.tensor(present, dtype=torch.float64)
        local = torch.cat([self.layout.grad_stats.view(-1, 2).sum(dim=0).double().cpu(), key, key * key])
        t = local.to(self.device)
        self.comm.all_reduce_sum(t)
        values = t.tolist()
        nb, w = len(self.layout.buckets), self.comm.world_size
        sums, squares = values[2 : 2 + nb], values[2 + nb :]
        bad = [k for k in range(nb) if abs(w * squares[k] - sums[k] ** 2) > 1e-6 * max(1.0, sums[k] ** 2)]
        if bad:
            b = self.layout.buckets[bad[0]]
            raise RuntimeError(
                f"hf_superoffload: the ranks got gradients for different parameters in {b.describe()} (first "
                "mismatch). Data-parallel training needs every rank to use the same parameters in every step (as "
                "DDP without find_unused_parameters): freeze parameters a rank may skip, or make the model use them "
                "on every rank."
            )
        return values[0], values[1]

    # -- after the verdict -------------------------------------------------------------------------
    def queue_gathers(self) -> None:
        """Queue every host bucket's all-gather on the gatherer thread, in need order (the same on every rank)."""
        for b in sorted(self.layout.host_buckets, key=self.layout.need_order):
            self._seq += 1
            self.gatherer.submit(self._seq, f"all-gather of {b.describe()}", lambda b=b: self._gather(b))

    def _gather(self, b: HostBucket) -> None:
        """Gatherer thread: all-gather every rank's updated shard of ``b`` and scatter it into the parameters."""
        if not b.uploaded.wait(self._timeout_s):
            raise TimeoutError(f"hf_superoffload: {b.describe()} was not uploaded after {self._timeout_s:.0f}s")
        self._raise_if_worker_failed()
        src = b.gather_src
        assert src is not None
        s = self.streams
        full_home = self.layout.full_home
        with torch.profiler.record_function("superoffload::all_gather"):
            if not s.is_cuda:
                full = torch.empty(b.spec.shard * self.comm.world_size, dtype=src.dtype)
                self.comm.all_gather(full, src)
                if full_home:
                    b.home.copy_(full[: b.spec.numel])
                else:
                    scatter_flat_(full[: b.spec.numel], b.params)
                event = None
            else:
                with torch.cuda.stream(s.gather):
                    if b.h2d_event is not None:
                        s.gather.wait_event(b.h2d_event)
                    full = torch.empty(b.spec.shard * self.comm.world_size, dtype=src.dtype, device=self.device)
                    self.comm.all_gather(full, src)  # the gather stream waits for it, not this thread
                    if full_home:  # weight flow: the bucket's bf16 weights go home, the streamer reads them
                        b.home.copy_(full[: b.spec.numel], non_blocking=True)
                    else:
                        scatter_flat_(full[: b.spec.numel], b.params)
                    event = s.record(s.gather)
                src.record_stream(s.gather)
                if full_home:
                    event.synchronize()  # this (gatherer) thread waits: the host copy is final once ready is set
                    event = None
        with self._lock:
            b.to_gathered(event)

    def gather_device(self, b: DeviceBucket) -> None:
        """Training thread: every rank's shard of a device-tail bucket into its parameters."""
        shard = b.master.to(self.dtype) if self.dtype != torch.float32 else b.master
        full = torch.empty(b.spec.shard * self.comm.world_size, dtype=shard.dtype, device=self.device)
        self.comm.all_gather(full, shard)
        scatter_flat_(full[: b.spec.numel], b.params)

    def gather_master(self, b: HostBucket | DeviceBucket, master: torch.Tensor) -> torch.Tensor | None:
        """After loading state (a collective): every rank's shard of ``master`` gathered; written into the bucket's
        whole-weights home (weight flow), else returned for the caller to scatter into the parameters."""
        shard = master.to(device=self.device, dtype=self.dtype)
        full = torch.empty(b.spec.shard * self.comm.world_size, dtype=self.dtype, device=self.device)
        self.comm.all_gather(full, shard)
        if isinstance(b, HostBucket) and self.layout.full_home:
            b.home.copy_(full[: b.spec.numel])
            return None
        return full[: b.spec.numel]
