"""Step telemetry: :class:`StepStats` of one iteration and the :class:`Telemetry` every stage adds to.

Any thread adds (the training thread, the CPU worker, the upload and gather threads); ``step()`` takes the
iteration's totals. The counters have their own lock: adding to them never waits for a bucket's state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from .validation import Verdict

__all__ = ["PassRecord", "StepStats", "Telemetry"]


@dataclass(frozen=True, slots=True)
class PassRecord:
    """One validated step's whole host pass, as the CPU worker ran it, whichever iterations it ran in (the rate
    calibration and the thread trial read it: [Note: calibrating the rates])."""

    wall_s: float
    """Wall seconds from the step's verdict until the worker had finished its last host bucket (``StepStats.pass_s``)."""
    adam_s: float
    """The worker's seconds in Adam and undo for the step's host buckets, its speculative share included."""
    clipped: bool
    """The step's verdict was a redo (clipping fired): its whole pass ran after the verdict."""
    undid: bool
    """The pass undid speculative work (an undo or redo adds passes a plain step does not have)."""
    threads: int
    """The CPU Adam threads the pass ran with."""


@dataclass(slots=True)
class StepStats:
    """Telemetry of one training iteration (from one ``step()`` to the next, host clock)."""

    grad_norm: float = float("nan")
    verdict: str = ""
    clip_coef: float = 1.0
    speculative: bool = False
    cpu_s: float = 0.0
    """Seconds the CPU worker spent in Adam (incl. undo/redo) during this iteration: the critical passes."""
    commit_s: float = 0.0
    """Seconds spent storing deferred moments ([Note: deferred moments]) during this iteration (off the critical
    path: when the worker is idle, at a bucket's next CPU task, or when a reader such as ``state_dict`` needs them)."""
    wait_s: float = 0.0
    """Seconds the training thread blocked on buckets during this iteration. The GPU may run work queued before
    a wait through part or all of it: ``gpu_idle_s`` is what it could not."""
    gpu_idle_s: float = 0.0
    """Seconds the compute stream sat idle inside those waits ([Note: idle inside a wait]): on a GPU, the gap
    between an event recorded on it where a wait began (done once the work queued before it is) and one recorded
    where the wait ended; on the CPU, where nothing runs ahead of the training thread, the waits themselves."""
    iteration_s: float = 0.0
    """Wall time of the iteration."""
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    speculated_buckets: int = 0
    """Host buckets of this step whose speculative step had begun when ``step()`` published its verdict."""
    wasted_buckets: int = 0
    """Host buckets of this step whose speculative step does not stand, each counted once: on a REDO or SKIP
    verdict every bucket speculated before it (undone; on REDO stepped again), and with the inverse rollback's
    algebraic undo in a speculative step also every bucket with a finite gradient the worker reaches after it (stepped speculatively,
    then undone: [Note: one path per bucket] in host_pass.py); 0 on COMMIT. Both counts belong to this step
    whatever the worker's timing: ``step()`` counts them when it publishes the verdict, although the undo and
    redo run after it returns (their seconds land in the next iteration's ``cpu_s``)."""
    master_deferred_buckets: int = 0
    """The share in force for this step: how many host buckets' verdict-known passes leave the fp32 master to the
    commit ([Note: adaptive master deferral]; 0 without deferred moments)."""
    moment_deferred_buckets: int = 0
    """How many host buckets' verdict-known passes of this step leave their moments to the commit (every host
    bucket with deferred moments, fewer where the adaptive split gave some back: [Note: adaptive moment deferral];
    0 without deferred moments)."""
    pass_s: float = 0.0
    """Wall seconds of the host pass that ran in this iteration: from the previous ``step()``'s verdict until the CPU
    worker had finished every host bucket of that step (pending commits it had to store first, undo and redo, Adam,
    handing over the uploads). The next forward overlaps it; ``wait_s`` is what it could not hide. The share of that
    pass is the previous step's ``master_deferred_buckets``. 0 after a skipped step, on the first step, and when the
    pass had not finished by this ``step()``."""
    host_pass: PassRecord | None = None
    """The pass ``pass_s`` times, whole: its Adam seconds, its speculative share (run before that step's verdict)
    included, unlike ``cpu_s``, its verdict and threads. ``None`` when ``pass_s`` is 0."""

    @property
    def overlap(self) -> float:
        """Share of the CPU Adam time hidden behind GPU work (1.0: fully hidden): what the GPU did not sit idle for."""
        return 1.0 - min(self.gpu_idle_s, self.cpu_s) / self.cpu_s if self.cpu_s > 0 else 1.0

    def as_log(self, prefix: str = "superoffload/") -> dict[str, float]:
        return {
            f"{prefix}cpu_adam_s": round(self.cpu_s, 4),
            f"{prefix}moment_commit_s": round(self.commit_s, 4),
            f"{prefix}gpu_wait_s": round(self.wait_s, 4),
            f"{prefix}gpu_idle_s": round(self.gpu_idle_s, 4),
            f"{prefix}overlap": round(self.overlap, 4),
            f"{prefix}link_gb": round((self.d2h_bytes + self.h2d_bytes) / 1e9, 6),
            f"{prefix}clip_coef": round(self.clip_coef, 6),
            f"{prefix}speculative": float(self.speculative),
            f"{prefix}master_deferred_buckets": float(self.master_deferred_buckets),
            f"{prefix}moment_deferred_buckets": float(self.moment_deferred_buckets),
            f"{prefix}pass_s": round(self.pass_s, 4),
        }


_COUNTERS = frozenset(f.name for f in fields(StepStats))


# [Note: idle inside a wait]
# The training thread blocks in a forward when a host bucket's update is not ready. The GPU does not stop with it: it
# runs what the thread queued before (the layers before, a checkpointed layer's recompute) and idles only once that
# is done. On the H100 box the 8B rows' thread waited 0.4-0.8 s per step in steps the roofline priced, within 1%, as
# all GPU time; counting those waits as idle made the calibration's busy time 10-20% short and its GEMM rate that
# much too fast. So each wait on a GPU records an event on the compute stream where it begins and one where it ends:
# the GPU reaches the first when the queued work is done and the second at once if it was idle by then, so the time
# between them is the idle gap. The pair is read at the ``step()`` after the GPU has passed both (the verdict waits
# for the backward, so by then it has); one it has not passed counts in a later iteration.


class Telemetry:
    """The counters of the iteration in progress (from the last ``step()`` on)."""

    _lock: threading.Lock
    _current: StepStats
    _last_step_t: float
    """Host clock at the last ``step()`` (or at construction): where the iteration in progress began."""
    _idle_marks: list[tuple[Any, Any]]
    """``(begun, ended)`` events of the waits whose idle gap is not counted yet ([Note: idle inside a wait])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = StepStats()
        self._last_step_t = time.perf_counter()
        self._idle_marks = []

    def mark_gpu_wait(self, begun: Any, ended: Any) -> None:
        """A wait's two timing events on the compute stream ([Note: idle inside a wait])."""
        with self._lock:
            self._idle_marks.append((begun, ended))

    def _count_idle(self) -> float:
        """Seconds of idle gap in the marked waits the GPU has passed; the others stay marked."""
        idle_ms, waiting = 0.0, []
        for begun, ended in self._idle_marks:
            if ended.query():
                idle_ms += begun.elapsed_time(ended)
            else:
                waiting.append((begun, ended))
        self._idle_marks = waiting
        return idle_ms / 1e3

    def add(self, **deltas: float) -> None:
        """``current.<name> += value`` for each keyword (any thread)."""
        assert _COUNTERS.issuperset(deltas), deltas
        with self._lock:
            for name, value in deltas.items():
                setattr(self._current, name, getattr(self._current, name) + value)

    @property
    def current(self) -> StepStats:
        """The running totals (a live object: read them, do not keep it across ``take``)."""
        return self._current

    def take(self) -> StepStats:
        """The iteration's totals; the counters start again from zero."""
        with self._lock:
            taken, self._current = self._current, StepStats()
            if self._idle_marks:
                taken.gpu_idle_s += self._count_idle()
        return taken

    def end_iteration(self, *, verdict: Verdict, speculative: bool, grad_divisor: float,
                      master_deferred_buckets: int, moment_deferred_buckets: int,
                      host_pass: PassRecord | None) -> StepStats:
        """The iteration's :class:`StepStats` at its ``step()``: the counters (``take``) and the verdict's numbers."""
        now = time.perf_counter()
        st = self.take()
        st.grad_norm, st.verdict, st.speculative = verdict.grad_norm, verdict.kind.value, speculative
        st.master_deferred_buckets, st.host_pass = master_deferred_buckets, host_pass
        st.moment_deferred_buckets = moment_deferred_buckets
        st.pass_s = host_pass.wall_s if host_pass is not None else 0.0
        st.clip_coef, st.iteration_s = verdict.grad_scale * grad_divisor, now - self._last_step_t
        self._last_step_t = now
        return st
