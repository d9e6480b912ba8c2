"""The in-process CPU worker: one thread, a priority queue of typed tasks, no polling.

The CPU Adam op releases the GIL and parallelises internally over its own threads, so a single
dispatching thread is enough. Tasks run by the engine's priorities: mostly *forward-need* order (the bucket the
next forward needs first goes first); with a D2H lead the backward's tasks in arrival order until the verdict, when
:meth:`CpuWorker.reprioritize` re-ranks the ones still waiting ([Note: D2H lead]). An exception stops the worker, is kept with its traceback, and is re-raised in the
training thread at its next interaction; ``on_error`` wakes every waiter at once.

A task may come with a *gate* (a blocking wait, e.g. on its gradient copy's event): a second thread runs the
gates in submission order and queues each task only once its gate has returned, so the worker never blocks on a
copy while other work (a deferred commit) is ready ([Note: D2H gate] in docs/design.md). A gated task counts as
outstanding from its submission (``drain`` waits for it) and is re-ranked by ``reprioritize`` like a queued one.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CpuWorker", "WorkerError"]

_LIVE: weakref.WeakValueDictionary[int, CpuWorker] = weakref.WeakValueDictionary()
"""Workers not closed yet, in creation order (an engine's worker before its helpers)."""
_ids = itertools.count()


@atexit.register
def _close_live_workers() -> None:
    """A script that ends without ``optimizer.close()`` must still exit cleanly: a daemon worker still inside a
    torch op when the interpreter finalizes aborted the process ("terminate called without an active exception",
    exit status 134, in ~30-50% of such exits on the dev box). Every live worker finishes its queued tasks (the
    last step's buckets) and stops here, before finalization."""
    for w in list(_LIVE.values()):
        w.close()


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
                 affinity: tuple[int, ...] | None = None, gated: bool = False) -> None:
        self._queue: queue.PriorityQueue[_Task] = queue.PriorityQueue()
        self._gates: queue.SimpleQueue[tuple[Callable[[], None], _Task] | None] = queue.SimpleQueue()
        self._gated_tasks: dict[int, _Task] = {}
        """The tasks whose gate has not returned yet, by ``seq`` (under ``_gate_lock``)."""
        self._gate_lock = threading.Lock()
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
        self._live_id = next(_ids)
        _LIVE[self._live_id] = self
        self._name = name
        self._gate_thread: threading.Thread | None = None
        if gated:
            self.enable_gate()

    def enable_gate(self) -> None:
        """Start the gate thread if it is not running (idempotent): a worker built ungated whose engine's new plan
        gates its first tasks ([Note: moving the tail to the host]). Safe at any time: an ungated worker refuses
        gated tasks, so none can be waiting for the thread."""
        with self._gate_lock:
            if self._gate_thread is not None:
                return
            if self._closed:
                raise WorkerError("the CPU worker is closed; build a new optimizer")
            self._gate_thread = threading.Thread(target=self._gate_loop, name=f"{self._name}-gate", daemon=True)
            self._gate_thread.start()

    def submit(self, priority: int, what: str, fn: Callable[[], None], *, tag: object = None,
               gate: Callable[[], None] | None = None) -> None:
        """Queue ``fn``; ``tag`` (any object) lets :meth:`reprioritize` find the task while it waits. With
        ``gate`` (a worker built ``gated=True`` or after :meth:`enable_gate`) the task is queued once ``gate()`` has
        returned; if it raises, the task fails with that error instead of running."""
        self.raise_if_failed()
        if self._closed:
            raise WorkerError("the CPU worker is closed; build a new optimizer")
        if gate is not None and self._gate_thread is None:
            raise ValueError("a gated task needs a worker with a gate thread: build it with gated=True or call "
                             "enable_gate() first")
        with self._cond:
            self._outstanding += 1
        task = _Task(priority, next(self._seq), what, fn, tag)
        if gate is None:
            self._queue.put(task)
            return
        with self._gate_lock:
            self._gated_tasks[task.seq] = task
        self._gates.put((gate, task))

    def _gate_loop(self) -> None:
        while True:
            item = self._gates.get()
            if item is None:
                return
            gate, task = item
            try:
                gate()
            except BaseException as exc:  # the task reports it: the worker's error path reaches the training thread

                def fail(exc: BaseException = exc) -> None:
                    raise exc

                task.fn = fail
            with self._gate_lock:  # reprioritize sees it either here or in the queue, never in between
                del self._gated_tasks[task.seq]
                self._queue.put(task)

    def reprioritize(self, new_priority: Callable[[object], int | None]) -> int:
        """Give every waiting task whose tag maps to a priority (``new_priority(tag)`` not ``None``) that
        priority; the order among equal priorities stays the submission order. Returns how many changed."""
        changed = 0
        q = self._queue
        with self._gate_lock, q.mutex:
            for task in itertools.chain(q.queue, self._gated_tasks.values()):
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
        _LIVE.pop(self._live_id, None)
        if self._gate_thread is not None:  # every gated task is queued before the shutdown below
            self._gates.put(None)
            if threading.current_thread() is not self._gate_thread:
                self._gate_thread.join(timeout=60)
        # after every queued task: a close() right after step() still finishes that step's buckets
        self._queue.put(_Task(2**62, next(self._seq), "shutdown", None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)

    @property
    def gated(self) -> bool:
        """Whether the gate thread runs (gated tasks are accepted)."""
        return self._gate_thread is not None

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
