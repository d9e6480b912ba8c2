"""Uploads: a final host bucket's bf16 weights go host to device, and the training thread waits for them.

The last stage of the data flow. [Note: stream ordering] and [Note: upload thread] in docs/design.md say which
wait protects which tensor: the upload waits for the bucket's D2H (the landing and staging buffers neighbour
each other); the forward's stream waits for the upload's event (``fwd_event``) before it reads the parameters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ..triton_kernels import scatter_flat_
from .bucket import BucketState, HostBucket
from .cpu_worker import CpuWorker
from .layout import BucketLayout
from .streams import StreamSet
from .telemetry import Telemetry

__all__ = ["Uploads"]


class Uploads:
    """Owns the uploads of the host buckets, the optional upload thread and the forward's waits for them.

    Attributes:
        thread: [Note: upload thread]: the H2D uploads leave the worker's critical path (stationary weights,
            one process), in FIFO order; ``None``: the worker uploads each bucket itself.
        unwaited: host buckets (by index) whose upload the compute stream has not waited for yet.
    """

    layout: BucketLayout
    streams: StreamSet
    thread: CpuWorker | None
    unwaited: set[int]
    _lock: threading.Lock
    _telemetry: Telemetry
    _sharded: bool
    _streamed: bool
    _seq: int
    _timeout_s: float
    _mark_inconsistent: Callable[[], None]
    _worker: CpuWorker
    _gatherer: CpuWorker | None

    def __init__(self, *, layout: BucketLayout, streams: StreamSet, lock: threading.Lock, telemetry: Telemetry,
                 worker: CpuWorker, gatherer: CpuWorker | None, streamed: bool, upload_thread: bool,
                 timeout_s: float, mark_inconsistent: Callable[[], None], on_error: Callable[[], None]) -> None:
        """
        Args:
            worker: the CPU worker (its failure surfaces in :meth:`wait`; its thread hands uploads over).
            gatherer: data parallel: the all-gather thread (only this rank's shard goes up; it assembles the
                bucket).
            streamed: weight flow: staging is the weights' home, the streamer fetches them (nothing to upload).
        """
        self.layout, self.streams = layout, streams
        self._worker, self._gatherer = worker, gatherer
        sharded = gatherer is not None
        self._lock, self._telemetry = lock, telemetry
        self._sharded, self._streamed = sharded, streamed
        self._timeout_s = timeout_s
        self._mark_inconsistent = mark_inconsistent
        self.thread = (CpuWorker(device=layout.device, on_error=on_error, name="superoffload-upload")
                       if upload_thread else None)
        self._seq = 0
        self.unwaited = set()

    def start_thread(self, on_error: Callable[[], None]) -> None:
        """Start the upload thread a plan asks for once it has host buckets ([Note: moving the tail to the host])."""
        if self.thread is None:
            self.thread = CpuWorker(device=self.layout.device, on_error=on_error, name="superoffload-upload")

    # -- CPU side ----------------------------------------------------------------------------------
    def hand_over(self, b: HostBucket, copy: int) -> None:
        """Upload ``b``'s weights from state copy ``copy``: on the upload thread when the CPU worker calls it (the
        worker goes on to the next bucket's Adam; FIFO keeps the finishing order), else right here."""
        thread = self.thread
        if thread is not None and not thread.failed and threading.current_thread() is self._worker.thread:
            self._seq += 1
            thread.submit(self._seq, f"upload of {b.describe()}", lambda: self._upload_task(b, copy))
        else:
            self.upload(b, copy)

    def _upload_task(self, b: HostBucket, copy: int) -> None:
        """The upload thread's task: a failure leaves a validated step's weights unfinished on the device."""
        try:
            self.upload(b, copy)
        except BaseException:
            self._mark_inconsistent()
            raise

    def upload(self, b: HostBucket, copy: int) -> None:
        if self._streamed and not self._sharded:  # weight flow: staging is the weights' home
            with self._lock:
                b.to_uploaded(None)
            return
        s = self.streams
        source = b.staging if b.staging is not None else b.pmv[copy][0]  # GPU cast: the fp32 master itself
        sharded = self._sharded  # data parallel: only this rank's shard goes up; the gatherer assembles
        with torch.profiler.record_function("superoffload::upload"):
            if not s.is_cuda:
                on_device, event = source, None
                if not sharded:
                    scatter_flat_(source, b.params)
            else:
                with torch.cuda.stream(s.h2d):
                    assert b.d2h is not None
                    b.d2h.wait_stream(s.h2d)
                    on_device = torch.empty(source.numel(), dtype=source.dtype, device=self.layout.device)
                    on_device.copy_(source, non_blocking=True)
                    if not sharded:
                        scatter_flat_(on_device, b.params)
                    event = s.record(s.h2d)
            if sharded:
                b.gather_src = on_device
        self._telemetry.add(h2d_bytes=source.numel() * source.element_size())
        with self._lock:
            b.to_uploaded(event, final=not sharded)

    # -- training thread ---------------------------------------------------------------------------
    def staging_final(self, b: HostBucket, *, block: bool, mid_step: bool) -> bool:
        """Weight flow: whether ``b``'s staging holds its final weights for the current step.

        A bucket is flushed (and may then be stepped speculatively, overwriting staging) only after every one
        of its parameters got its gradient, i.e. after their last use in this step's backward. A forward in
        the window between that and ``step()`` (``mid_step``) would read a half-updated step: it is refused.
        """
        if b.state in (BucketState.IDLE, BucketState.UPLOADED) and b.ready.is_set():
            return True
        if mid_step:
            raise RuntimeError(
                f"weight flow: {b.describe()} is needed between backward() and optimizer.step(), after its "
                "gradients were offloaded; its host weights are being updated. Call optimizer.step() before the "
                "next forward (for gradient accumulation run the non-final micro-batches inside "
                "`with optimizer.no_sync():`)."
            )
        if not block:
            return False
        self.wait(b, mid_step=mid_step, for_stream=False)
        return True

    def expect(self, b: HostBucket) -> None:
        """``b`` was offloaded: the next forward must wait for its upload."""
        self.unwaited.add(b.index)

    def forget(self, b: HostBucket) -> None:
        """``b``'s step was skipped: its parameters on the device never changed."""
        self.unwaited.discard(b.index)

    def wait(self, b: HostBucket, *, mid_step: bool, for_stream: bool) -> None:
        """Block until ``b``'s parameters are final; then order the current stream after its upload.

        ``mid_step``: the step's verdict is not known yet, so the device still holds the previous, valid weights
        (nothing is uploaded before validation): a forward in the middle of a step does not wait.
        """
        if mid_step and for_stream:
            return
        worker = self._worker
        if not b.ready.is_set():
            # [Note: idle inside a wait] in telemetry.py: the GPU runs what was queued before the wait. A wait that
            # orders no stream (a host read of the weights) keeps no GPU waiting: it counts no idle time there
            cuda = self.layout.device.type == "cuda"
            timed = cuda and for_stream
            if timed:
                begun = torch.cuda.Event(enable_timing=True)
                begun.record(torch.cuda.current_stream(self.layout.device))
            t0 = time.perf_counter()
            with torch.profiler.record_function("superoffload::wait_cpu"):
                finished = b.ready.wait(self._timeout_s)
            waited = time.perf_counter() - t0
            if timed:
                ended = torch.cuda.Event(enable_timing=True)
                ended.record(torch.cuda.current_stream(self.layout.device))
                self._telemetry.mark_gpu_wait(begun, ended)
            self._telemetry.add(wait_s=waited, gpu_idle_s=0.0 if cuda else waited)
            worker.raise_if_failed()
            if not finished:
                raise TimeoutError(
                    f"hf_superoffload: {b.describe()} was not ready after {self._timeout_s:.0f}s "
                    f"(worker alive: {worker.alive}). Raise SuperOffloadConfig.worker_timeout_s if the "
                    "CPU is this slow, or report a bug."
                )
        worker.raise_if_failed()
        for helper in (self._gatherer, self.thread):
            if helper is not None:
                helper.raise_if_failed()
        if for_stream and not b.stream_waited:
            if b.fwd_event is not None:
                torch.cuda.current_stream(self.layout.device).wait_event(b.fwd_event)
            b.stream_waited = True
            self.unwaited.discard(b.index)
