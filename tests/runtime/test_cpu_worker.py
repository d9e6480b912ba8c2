"""CpuWorker: priority order, and reprioritize() re-ranks waiting tagged tasks (the engine's verdict handover)."""

from __future__ import annotations

import threading

import torch

from hf_superoffload.runtime.cpu_worker import CpuWorker


def _blocked_worker() -> tuple[CpuWorker, threading.Event, list[str]]:
    w = CpuWorker(device=torch.device("cpu"), on_error=lambda: None)
    gate, ran = threading.Event(), []
    w.submit(-100, "gate", gate.wait)  # holds the worker while the test queues the rest
    return w, gate, ran


def test_tasks_run_by_priority_then_submission_order() -> None:
    w, gate, ran = _blocked_worker()
    for prio, name in [(3, "c"), (1, "a"), (3, "d"), (2, "b")]:
        w.submit(prio, name, lambda n=name: ran.append(n))
    gate.set()
    w.drain(10)
    assert ran == ["a", "b", "c", "d"]
    w.close()


def test_reprioritize_reranks_only_tagged_waiting_tasks() -> None:
    w, gate, ran = _blocked_worker()
    # arrival order (the engine's lead mode): tagged 0, 1, 2 ahead of an untagged finishing task at 0
    for k in range(3):
        w.submit(-10 + k, f"bucket{k}", lambda k=k: ran.append(f"bucket{k}"), tag=k)
    w.submit(0, "finish", lambda: ran.append("finish"))
    w.submit(5, "untouched", lambda: ran.append("untouched"), tag="other")
    changed = w.reprioritize(lambda tag: (-1 - tag) if isinstance(tag, int) else None)  # need order: reversed
    assert changed == 3
    gate.set()
    w.drain(10)
    assert ran == ["bucket2", "bucket1", "bucket0", "finish", "untouched"]
    assert w.reprioritize(lambda tag: 0) == 0  # nothing waits any more
    w.close()
