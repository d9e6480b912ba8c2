"""The in-process CPU worker: one thread, a priority queue of typed tasks, no polling.

The CPU Adam op releases the GIL and parallelises internally over its own threads, so a single
dispatching thread is enough. Tasks run by the engine's priorities: mostly *forward-need* order (the bucket the
next forward needs first goes first); with a D2H lead the backward's tasks in arrival order until the verdict, when
:meth:`CpuWorker.reprioritize` re-ranks the ones still waiting ([Note: D2H lead]). An exception stops the worker, is kept with its traceback, and is re-raised in the
training thread at its next interaction; ``on_error`` wakes every waiter at once.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CpuWorker", "WorkerError"]


class WorkerError(RuntimeError):
    """The CPU worker failed; ``__cause__`` carries the original exception and traceback."""


@dataclass(order=True, slots=True)
class _Task:
    priority: int
    seq: int
    what: str = field(compare=False)
    fn: Callable[[], None] | None = field(compare=False)
    tag: object = field(compare=False, default=None)


class CpuWorker:
    """A single daemon thread executing submitted callables by priority (lower first)."""

    def __init__(self, *, device: torch.device, on_error: Callable[[], None], name: str = "superoffload-cpu",
                 affinity: tuple[int, ...] | None = None) -> None:
        self._queue: queue.PriorityQueue[_Task] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._device = device
        self._on_error = on_error
        self._error: BaseException | None = None
        self._failed_task = ""
        self._outstanding = 0
        self._cond = threading.Condition()
        self._closed = False
        self._affinity = affinity
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, priority: int, what: str, fn: Callable[[], None], *, tag: object = None) -> None:
        """Queue ``fn``; ``tag`` (any object) lets :meth:`reprioritize` find the task while it waits."""
        self.raise_if_failed()
        if self._closed:
            raise WorkerError("the CPU worker is closed; build a new optimizer")
        with self._cond:
            self._outstanding += 1
        self._queue.put(_Task(priority, next(self._seq), what, fn, tag))

    def reprioritize(self, new_priority: Callable[[object], int | None]) -> int:
        """Give every waiting task whose tag maps to a priority (``new_priority(tag)`` not ``None``) that
        priority; the order among equal priorities stays the submission order. Returns how many changed."""
        changed = 0
        q = self._queue
        with q.mutex:
            for task in q.queue:
                if task.tag is not None and (p := new_priority(task.tag)) is not None and p != task.priority:
                    task.priority = p
                    changed += 1
            if changed:
                heapq.heapify(q.queue)
        return changed

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise WorkerError(f"CPU optimizer worker failed while running {self._failed_task}: {self._error!r}") from self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def drain(self, timeout: float) -> None:
        """Block until every submitted task has finished (or the worker failed)."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._outstanding == 0 or self._error is not None, timeout)
        self.raise_if_failed()
        if not done:
            raise TimeoutError(f"CPU optimizer worker did not finish its {self._outstanding} task(s) in {timeout:.0f}s")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # after every queued task: a close() right after step() still finishes that step's buckets
        self._queue.put(_Task(2**62, next(self._seq), "shutdown", None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    @property
    def thread(self) -> threading.Thread:
        """The thread that runs the tasks (a task can tell whether it runs there)."""
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread; the worker writes into leaf parameters
        if self._affinity and hasattr(os, "sched_setaffinity"):
            # this thread only (Linux: pid 0 is the calling thread); the CPU Adam's threads inherit it
            os.sched_setaffinity(0, self._affinity)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            task = self._queue.get()
            if task.fn is None:
                return
            if self._error is None:
                try:
                    task.fn()
                except BaseException as exc:  # everything must reach the training thread
                    self._failed_task = task.what
                    self._error = exc
                    try:
                        self._on_error()
                    finally:
                        with self._cond:
                            self._cond.notify_all()
            with self._cond:
                self._outstanding -= 1
                self._cond.notify_all()
