"""Buckets: the unit of offload. Each owns its tensors and its lifecycle state.

[Note: bucket lifecycle] in docs/design.md. A host bucket moves through

    IDLE/UPLOADED --flush--> OFFLOADED --worker--> SPECULATED --verdict--> UPLOADED
                                          \\-----> DEFERRED   --verdict--> UPLOADED
                                          (SKIP: SPECULATED/DEFERRED --> IDLE, state restored)

Transitions are methods that check the source state; nothing else assigns ``state``.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import torch

from ..planning.plan import BucketSpec
from .streams import Handoff
from .validation import GroupHypers

__all__ = ["BucketState", "DeviceBucket", "HostBucket", "MomentCommit", "Run"]


class BucketState(enum.Enum):
    IDLE = "idle"
    """No step in flight; the parameters on the device are final. Landing/staging buffers free."""
    OFFLOADED = "offloaded"
    """Gradients flattened and copied toward the host (``d2h`` event); a CPU task is queued."""
    RUNNING = "running"
    """The worker is stepping it (fp32 p/m/v and staging are being written)."""
    DEFERRED = "deferred"
    """Gradients on the host, waiting for the verdict (speculation off or a non-finite gradient)."""
    SPECULATED = "speculated"
    """Stepped before validation; the undo data (the other state copy, or the landing gradient) is live."""
    UPLOADED = "uploaded"
    """Final; the bf16 weights were sent to the device (``h2d`` event). Staging is read by the DMA."""


@dataclass(frozen=True, slots=True)
class Run:
    """A contiguous slice of a bucket that steps with one group's hyper-parameters and one step count."""

    start: int
    end: int
    group: int
    step: int


@dataclass(frozen=True, slots=True)
class MomentCommit:
    """The moment stores a deferred step of a host bucket still owes ([Note: deferred moments] in docs/design.md).

    The step wrote p and the bf16 weights of ``runs`` into state copy ``dst`` and left ``exp_avg``/``exp_avg_sq``
    unstored; the commit computes them from copy ``src``'s pre-step moments (the same copy in place) and ``grad``
    (the landing buffer that step read, kept alive by the doubled landing arena) with ``hypers`` (a run of group
    ``g`` used ``hypers[g]``; the moments read only its betas) and ``grad_scale``, exactly as the step did.

    ``master`` (deferred master stores): the step wrote the bf16 weights only; the commit runs the whole step
    again from copy ``src`` with the same ``hypers`` and stores p, m and v into ``dst``.
    """

    runs: tuple[Run, ...]
    hypers: GroupHypers
    grad_scale: float
    src: int
    dst: int
    grad: torch.Tensor
    master: bool = False


class _BucketBase:
    spec: BucketSpec
    params: list[torch.nn.Parameter]
    sizes: list[int]
    runs: tuple[Run, ...]  # this step's stepped slices of this rank's shard (shard coordinates)
    bucket_runs: tuple[Run, ...]  # the same for the whole bucket (bucket coordinates; every rank agrees)

    def __init__(self, spec: BucketSpec, params: list[torch.nn.Parameter]) -> None:
        self.spec = spec
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.runs = ()
        self.bucket_runs = ()

    @property
    def index(self) -> int:
        return self.spec.index

    def plan_runs(self, has_grad: list[bool], groups: list[int], steps: list[int]) -> tuple[Run, ...]:
        """Slices of the parameters that got a gradient, merged where group and step count agree."""
        runs: list[Run] = []
        offset = 0
        for n, has, g, s in zip(self.sizes, has_grad, groups, steps, strict=True):
            if has:
                if runs and runs[-1].end == offset and runs[-1].group == g and runs[-1].step == s + 1:
                    runs[-1] = Run(runs[-1].start, offset + n, g, s + 1)
                else:
                    runs.append(Run(offset, offset + n, g, s + 1))
            offset += n
        return tuple(runs)

    def clip_runs(self, runs: tuple[Run, ...]) -> tuple[Run, ...]:
        """``runs`` (bucket coordinates) restricted to this rank's shard, in shard coordinates."""
        lo, hi = self.spec.lo, self.spec.lo + self.spec.length
        if lo == 0 and hi == self.spec.numel:
            return runs
        return tuple(Run(max(r.start, lo) - lo, min(r.end, hi) - lo, r.group, r.step)
                     for r in runs if r.start < hi and r.end > lo)

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """``(k, start, end, at)``: elements ``[start, end)`` of ``params[k]`` (flattened) are this rank's
        shard elements ``[at, at + end - start)``."""
        lo, hi = self.spec.lo, self.spec.lo + self.spec.length
        out, offset = [], 0
        for k, n in enumerate(self.sizes):
            s, e = max(offset, lo), min(offset + n, hi)
            if s < e:
                out.append((k, s - offset, e - offset, s - lo))
            offset += n
        return out


class HostBucket(_BucketBase):
    """A bucket whose fp32 master and Adam state live in host RAM.

    Attributes:
        pmv: per host state copy (one, or two when double-buffered), fp32 ``[numel]`` views of
            (master, exp_avg, exp_avg_sq) into that copy's arenas.
        landing: ``[numel]`` model-dtype view into the page-locked gradient landing arena (D2H target).
        landings: the bucket's views of every landing arena: one, or two with deferred moment stores (a step's
            gradient must outlive the next step's D2H until its moments are committed; see :meth:`next_landing`).
        pending: the moment stores a deferred step still owes (``None``: none); guarded by ``commit_lock``.
        staging: ``[numel]`` model-dtype view into the page-locked weight staging arena (H2D source).
        home: weight flow: where the streamer reads the bucket's bf16 weights: ``staging`` on one process, a
            whole-bucket view of the full weights arena with data parallelism (staging holds one shard).
        gaps: slices of the shard that were not stepped this step (parameters without a gradient).
        d2h: the landing gradient and the event after which the host may read it.
        h2d_event: recorded after the upload that reads ``staging`` (or the master) was queued.
        fwd_event: the event the next forward's stream waits on: the scatter into the parameters (single
            process: ``h2d_event``; data parallel: after the all-gather of every rank's shard).
        uploaded: set once this rank's shard is final and uploaded (data parallel: the gatherer waits on it).
        ready: set when the parameters on the device are final for the current step (or will be once a
            stream waits on ``fwd_event``); the next forward blocks on it.
        applied: (per-group hyper-parameters, grad scale) of the step currently applied to the state, for undo.
        grad: the host gradient this step's CPU Adam reads: ``landing``, or the host accumulation's sum.
        accumulated: this step's gradient was summed over micro-batches on the host; its statistics come from
            the accumulator, not from the device ([Note: host accumulation]).
    """

    pmv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    landing: torch.Tensor
    landings: tuple[torch.Tensor, ...]
    pending: MomentCommit | None
    commit_lock: threading.Lock
    grad: torch.Tensor
    accumulated: bool
    staging: torch.Tensor | None
    home: torch.Tensor | None
    gaps: tuple[tuple[int, int], ...]
    d2h: Handoff | None
    h2d_event: torch.cuda.Event | None
    fwd_event: torch.cuda.Event | None
    uploaded: threading.Event
    gather_src: torch.Tensor | None
    ready: threading.Event
    stream_waited: bool
    applied: tuple[GroupHypers, float] | None

    def __init__(self, spec: BucketSpec, params: list[torch.nn.Parameter]) -> None:
        super().__init__(spec, params)
        self.state = BucketState.IDLE
        self.d2h = None
        self.h2d_event = None
        self.fwd_event = None
        self.gather_src = None
        self.uploaded = threading.Event()
        self.uploaded.set()
        self.ready = threading.Event()
        self.ready.set()
        self.stream_waited = True
        self.applied = None
        self.accumulated = False
        self.pmv = []
        self.landings = ()
        self.pending = None
        self.commit_lock = threading.Lock()
        self.gaps = ()
        self.staging = None
        self.home = None

    def drop_views(self) -> None:
        """Forget the views of the host arenas (the layout regrows them, then binds the bucket again). Idle only."""
        self._expect(BucketState.IDLE, BucketState.UPLOADED)
        assert self.pending is None, "a moment store was still pending when the arenas were regrown"
        self.pmv, self.landings, self.d2h = [], (), None
        del self.landing, self.grad
        self.staging = self.home = None

    def next_landing(self) -> torch.Tensor:
        """The landing buffer this step's gradient goes to (training thread, at the flush): with two, the one a
        pending moment commit does not read (the buffers alternate from step to step)."""
        if len(self.landings) > 1:
            pending = self.pending  # read once: the worker may commit (and clear) it meanwhile
            busy = pending.grad if pending is not None else self.landing
            self.landing = self.landings[1] if busy is self.landings[0] else self.landings[0]
        return self.landing

    def _expect(self, *states: BucketState) -> None:
        if self.state not in states:
            raise AssertionError(f"bucket {self.index}: in state {self.state.name}, expected one of "
                                 f"{[s.name for s in states]}")

    # -- transitions -------------------------------------------------------------------------------
    def to_offloaded(self, runs: tuple[Run, ...], d2h: Handoff) -> None:
        self._expect(BucketState.IDLE, BucketState.UPLOADED)
        self.runs, self.d2h = runs, d2h
        covered, gaps = 0, []
        for r in runs:
            if r.start > covered:
                gaps.append((covered, r.start))
            covered = r.end
        if covered < self.spec.length:
            gaps.append((covered, self.spec.length))
        self.gaps = tuple(gaps)
        self.uploaded.clear()
        self.ready.clear()
        self.stream_waited = False
        self.applied = None
        self.state = BucketState.OFFLOADED

    def to_running(self) -> None:
        self._expect(BucketState.OFFLOADED, BucketState.DEFERRED, BucketState.SPECULATED)
        self.state = BucketState.RUNNING

    def to_deferred(self) -> None:
        self._expect(BucketState.OFFLOADED)
        self.state = BucketState.DEFERRED

    def to_speculated(self) -> None:
        self._expect(BucketState.RUNNING)
        self.state = BucketState.SPECULATED

    def to_uploaded(self, h2d_event: torch.cuda.Event | None, *, final: bool = True) -> None:
        """This rank's shard is uploaded; ``final``: it is the whole bucket (no all-gather follows)."""
        self._expect(BucketState.RUNNING)
        self.h2d_event = h2d_event
        self.state = BucketState.UPLOADED
        self.uploaded.set()
        if final:
            self.fwd_event = h2d_event
            self.ready.set()

    def to_gathered(self, fwd_event: torch.cuda.Event | None) -> None:
        """Data parallel: every rank's shard was gathered and scattered into the parameters."""
        self._expect(BucketState.UPLOADED)
        self.fwd_event = fwd_event
        self.gather_src = None
        self.ready.set()

    def to_idle_skipped(self) -> None:
        self._expect(BucketState.RUNNING, BucketState.DEFERRED, BucketState.SPECULATED)
        self.h2d_event = None
        self.stream_waited = True
        self.state = BucketState.IDLE
        self.uploaded.set()
        self.ready.set()

    def describe(self) -> str:
        return f"bucket {self.index} ({len(self.params)} params, {self.spec.numel / 1e6:.1f}M elements, {self.state.name})"


class DeviceBucket(_BucketBase):
    """A bucket of the GPU-resident tail: fp32 master and Adam state on the model's device.

    Attributes:
        master, exp_avg, exp_avg_sq: fp32 ``[numel]`` views into the device arenas.
        grad: this step's flattened gradient (model dtype), or ``None`` between steps.
    """

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor | None

    def __init__(self, spec: BucketSpec, params: list[torch.nn.Parameter]) -> None:
        super().__init__(spec, params)
        self.grad = None

    def drop_state(self) -> None:
        """Forget the views of the device arenas: the bucket moved to the host, and a view would keep the old arena
        alive while its replacement is allocated ([Note: restaging the device arenas] in runtime/tail_move.py)."""
        del self.master, self.exp_avg, self.exp_avg_sq
