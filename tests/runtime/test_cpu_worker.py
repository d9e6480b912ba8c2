"""CpuWorker: priority order, reprioritize() re-ranks waiting tagged tasks (the engine's verdict handover), and gated
tasks ([Note: D2H gate]) wait for their gate without blocking the worker."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_superoffload.runtime.cpu_worker import CpuWorker, WorkerError


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


# ------------------------------------------------------------------------------------------------ gated tasks
def _gated_worker() -> CpuWorker:
    return CpuWorker(device=torch.device("cpu"), on_error=lambda: None, gated=True)


def test_a_gated_task_waits_for_its_gate_while_the_worker_runs_the_rest() -> None:
    """[Note: D2H gate]: the worker never blocks on a gate; less urgent ready work runs meanwhile."""
    w = _gated_worker()
    copy_done, ran = threading.Event(), []
    later_ran = threading.Event()
    w.submit(0, "first task", lambda: ran.append("first"), gate=copy_done.wait)
    w.submit(10, "idle commit", lambda: (ran.append("commit"), later_ran.set()))
    assert later_ran.wait(10)  # ran although a more urgent task was submitted first: it was gated
    assert ran == ["commit"]
    with pytest.raises(TimeoutError):
        w.drain(0.2)  # the gated task is outstanding
    copy_done.set()
    w.drain(10)
    assert ran == ["commit", "first"]
    w.close()


def test_gates_run_in_submission_order_and_reprioritize_reaches_gated_tasks() -> None:
    w = _gated_worker()
    hold = threading.Event()
    w.submit(-100, "hold", hold.wait)  # keeps the worker busy so released tasks queue up
    gates = [threading.Event() for _ in range(3)]
    order: list[int] = []
    ran: list[str] = []

    def gate(k: int) -> None:
        gates[k].wait()
        order.append(k)

    for k in range(3):  # arrival order, tagged like the engine's first tasks
        w.submit(-10 + k, f"bucket{k}", lambda k=k: ran.append(f"bucket{k}"), tag=k, gate=lambda k=k: gate(k))
    released = threading.Event()
    w.submit(100, "last", lambda: ran.append("last"), gate=released.set)  # its gate runs after the three released
    gates[2].set()
    gates[0].set()  # gate 1 still closed: bucket 0 is released, bucket 2's gate waits behind gate 1
    assert w.reprioritize(lambda tag: -1 - tag) == 3  # the verdict: need order, released or not
    gates[1].set()
    assert released.wait(10)
    hold.set()
    w.drain(10)
    assert order == [0, 1, 2]
    assert ran == ["bucket2", "bucket1", "bucket0", "last"]
    w.close()


def test_a_failing_gate_fails_its_task_and_close_releases_gated_tasks() -> None:
    errors: list[str] = []
    w = CpuWorker(device=torch.device("cpu"), on_error=lambda: errors.append("woken"), gated=True)

    def broken_gate() -> None:
        raise RuntimeError("CUDA error: the copy failed")

    ran: list[str] = []
    w.submit(0, "CPU Adam of bucket 3", lambda: ran.append("ran"), gate=broken_gate)
    with pytest.raises(WorkerError, match=r"CPU Adam of bucket 3.*the copy failed"):
        w.drain(10)
    assert ran == [] and errors == ["woken"]
    w.close()

    w = _gated_worker()
    slow = threading.Event()
    w.submit(0, "gated", lambda: ran.append("gated"), gate=lambda: slow.wait(0.2))
    w.close()  # returns after the gated task ran: close() finishes what was submitted
    assert ran == ["gated"]
    with pytest.raises(ValueError, match="gated=True"):
        CpuWorker(device=torch.device("cpu"), on_error=lambda: None).submit(0, "x", lambda: None, gate=lambda: None)


def test_enable_gate_starts_one_gate_thread_on_demand() -> None:
    """A worker built ungated refuses gated tasks until ``enable_gate()``; calling it again starts no second
    thread, and a closed worker refuses it."""
    w = CpuWorker(device=torch.device("cpu"), on_error=lambda: None, name="superoffload-cpu-on-demand")
    ran: list[str] = []
    assert not w.gated
    with pytest.raises(ValueError, match="enable_gate"):
        w.submit(0, "gated", lambda: ran.append("gated"), gate=lambda: None)
    w.enable_gate()
    w.enable_gate()
    assert w.gated
    assert sum(t.name == "superoffload-cpu-on-demand-gate" for t in threading.enumerate()) == 1
    w.submit(0, "gated", lambda: ran.append("gated"), gate=lambda: None)
    w.drain(10)
    assert ran == ["gated"]
    w.close()
    closed = CpuWorker(device=torch.device("cpu"), on_error=lambda: None)
    closed.close()
    with pytest.raises(WorkerError, match="closed"):
        closed.enable_gate()
