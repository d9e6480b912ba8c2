"""Faults inside a training step: non-finite gradients, a failing CPU worker, KeyboardInterrupt (and any other
exception) in backward or in the CPU step, and the worker thread's lifetime.

Promises (docs/reliability.md): the optimizer state after a fault is exactly the state before the step (or the
engine refuses to checkpoint it), errors surface within seconds with their original traceback, ``close()``
leaves no thread behind, and training can go on from ``opt.state_dict()``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload import ops as ops_module
from hf_superoffload.runtime import device_tail
from hf_superoffload.runtime.cpu_worker import WorkerError
from hf_superoffload.testing import tiny_llama

SKIP_MSG = "non-finite gradient, step skipped"


def _late_param(model: torch.nn.Module) -> torch.nn.Parameter:
    """First layer's q_proj: its gradient arrives late in backward, after other buckets were speculated."""
    return model.model.layers[0].self_attn.q_proj.weight


# ---------------------------------------------------------------------------------------------------------
# non-finite gradients
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_gradient_is_skipped_with_a_warning_and_a_counter(rel: Any, bad: float, caplog: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model, max_grad_norm=1.0)
    rel.train(model, opt, rel.batches(2))
    before = rel.snapshot(model, opt)
    ids = rel.batches(1, seed=7)[0]
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        for k in (1, 2):
            (model(input_ids=ids, labels=ids).loss * bad).backward()
            opt.step()
            opt.zero_grad()
            assert opt.skipped_steps == k and opt.step_was_skipped
            assert not math.isfinite(opt.last_grad_norm)
    warnings = [r for r in caplog.records if r.name == "hf_superoffload" and SKIP_MSG in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING] * 2
    assert "(1 so far)" in warnings[0].getMessage() and "(2 so far)" in warnings[1].getMessage()
    rel.assert_same_state(before, rel.snapshot(model, opt))  # skipped bit-exactly (both steps)
    # the next finite step goes through; the counter keeps the history
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        rel.train(model, opt, rel.batches(1, seed=8))
    assert not opt.step_was_skipped and opt.skipped_steps == 2
    assert not [r for r in caplog.records if SKIP_MSG in r.getMessage()]
    assert opt.engine.param_steps == [s + 1 for s in before["steps"]]


# ---------------------------------------------------------------------------------------------------------
# CPU worker failures and thread lifetime
def test_worker_exception_keeps_the_original_traceback_and_close_leaves_no_thread(rel: Any, monkeypatch: Any) -> None:
    threads_before = rel.worker_threads()
    model = tiny_llama()
    opt = rel.optimizer(model)
    ours = rel.worker_threads() - threads_before
    assert len(ours) == 1 + opt.plan.d2h_gate, "one CPU worker thread per optimizer (and its D2H gate's)"
    rel.train(model, opt, rel.batches(1))

    def broken_cpu_adam(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected CPU Adam failure")

    monkeypatch.setattr(ops_module, "cpu_adamw_step_", broken_cpu_adam)
    ids = rel.batches(1, seed=9)[0]
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="injected CPU Adam failure") as info:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()  # raises here when the worker already failed (its speculative step ran during backward)...
        opt.synchronize()  # ...and at the latest at the next interaction (a loaded machine may run it later)
    assert time.perf_counter() - t0 < 10
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError)
    assert traceback.extract_tb(cause.__traceback__)[-1].name == "broken_cpu_adam", "original traceback lost"
    opt.close()
    for t in ours:
        t.join(timeout=10)
        assert not t.is_alive(), "the CPU worker thread outlived close()"
    opt.close()  # idempotent
    assert rel.worker_threads() <= threads_before


def test_close_stops_the_worker_of_a_healthy_optimizer(rel: Any) -> None:
    threads_before = rel.worker_threads()
    model = tiny_llama()
    opt = rel.optimizer(model)
    rel.train(model, opt, rel.batches(2))
    ours = rel.worker_threads() - threads_before
    opt.close()
    for t in ours:
        t.join(timeout=10)
        assert not t.is_alive()
    # after close the state can still be read (for a final save)
    assert opt.state_dict()["superoffload"]["format"] == "hf_superoffload.optimizer.v2"


def test_close_right_after_step_finishes_that_step_without_hanging(rel: Any, monkeypatch: Any) -> None:
    """E.g. Ctrl-C in the next forward, then ``opt.close()``; or a script that closes without synchronize()."""
    cfg = rel.CFG.replace(speculation=False, worker_timeout_s=5)  # the CPU work runs after step() returns
    data = rel.batches(3)
    ref_model = tiny_llama()
    ref = rel.optimizer(ref_model, config=cfg)
    rel.train(ref_model, ref, data)
    expected = rel.snapshot(ref_model, ref)

    real = ops_module.cpu_adamw_step_

    def slow_cpu_adam(*args: Any, **kwargs: Any) -> None:  # a large model: the CPU finishes well after step()
        time.sleep(0.02)
        real(*args, **kwargs)

    monkeypatch.setattr(ops_module, "cpu_adamw_step_", slow_cpu_adam)
    model = tiny_llama()
    opt = rel.optimizer(model, config=cfg)
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    t0 = time.perf_counter()
    sd = opt.state_dict()
    assert time.perf_counter() - t0 < 2, "state_dict() after close() hung"
    assert sd["superoffload"]["param_steps"].tolist() == expected["steps"]
    rel.assert_same_state(expected, rel.snapshot(model, opt, sync=False))


def test_a_second_optimizer_on_the_same_model_works_or_is_refused_clearly(rel: Any) -> None:
    threads_before = rel.worker_threads()
    model = tiny_llama()
    first = rel.optimizer(model)  # e.g. a notebook cell run twice: `opt = SuperOffloadOptimizer(model, ...)`
    first_thread = rel.worker_threads() - threads_before
    try:
        second = rel.optimizer(model)
    except (RuntimeError, ValueError) as e:  # refusing at construction, naming the fix, is fine too
        assert "close()" in str(e)
        return
    rel.train(model, second, rel.batches(3))
    assert second.engine.param_steps == [3] * len(second.engine.params)
    for t in first_thread:
        t.join(timeout=10)
        assert not t.is_alive(), "the replaced optimizer still runs a worker thread"
    del first


# ---------------------------------------------------------------------------------------------------------
# KeyboardInterrupt (or e.g. a CUDA OOM) raised in backward, after some buckets were offloaded and speculated
def _raise_from_backward(model: torch.nn.Module, exc: type[BaseException], ids: torch.Tensor) -> None:
    def hook(grad: torch.Tensor) -> None:
        raise exc("injected during backward")

    handle = _late_param(model).register_hook(hook)
    try:
        with pytest.raises(exc, match="injected during backward"):
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        handle.remove()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, torch.OutOfMemoryError], ids=["KeyboardInterrupt", "OOM"])
@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
def test_exception_in_backward_then_abort_step_restores_the_state(rel: Any, rollback: str, exc: Any) -> None:
    """What works today: ``opt.engine.abort_step()`` after the exception, then the same optimizer goes on."""
    model = tiny_llama()
    opt = rel.optimizer(model, config=rel.CFG.replace(rollback=rollback))
    rel.train(model, opt, rel.batches(2))
    before = rel.snapshot(model, opt)
    _raise_from_backward(model, exc, rel.batches(1, seed=5)[0])
    assert opt.engine.step_in_progress
    opt.engine.abort_step()
    opt.zero_grad()
    # double buffer: bit-exact; inverse: the speculated buckets are undone algebraically (fp32 rounding)
    rel.assert_same_state(before, rel.snapshot(model, opt), exact=rollback == "double_buffer")
    losses = rel.train(model, opt, rel.batches(2, seed=6))
    assert all(math.isfinite(x) for x in losses)
    assert opt.engine.param_steps == [s + 2 for s in before["steps"]]


@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
def test_keyboard_interrupt_in_backward_then_close_and_resume_from_state_dict(rel: Any, rollback: str) -> None:
    cfg = rel.CFG.replace(rollback=rollback)
    data = rel.batches(4)
    threads_before = rel.worker_threads()
    model = tiny_llama()
    opt = rel.optimizer(model, config=cfg)
    ours = rel.worker_threads() - threads_before
    rel.train(model, opt, data[:2])
    before = rel.snapshot(model, opt)
    _raise_from_backward(model, KeyboardInterrupt, rel.batches(1, seed=5)[0])
    opt.close()
    for t in ours:
        t.join(timeout=10)
        assert not t.is_alive()
    rel.assert_same_state(before, rel.snapshot(model, opt, sync=False), exact=rollback == "double_buffer")
    sd = opt.state_dict()
    opt.zero_grad()
    new = rel.optimizer(model, config=cfg)
    new.load_state_dict(sd)
    rel.train(model, new, data[2:])
    # same as never interrupted
    ref_model = tiny_llama()
    ref = rel.optimizer(ref_model, config=cfg)
    rel.train(ref_model, ref, data)
    # inverse: the undo's fp32 rounding may flip a bf16 weight, which Adam then carries (as in test_parity)
    exact = rollback == "double_buffer"
    rel.assert_same_state(rel.snapshot(ref_model, ref), rel.snapshot(model, new), exact=exact, weights=exact,
                          atol=8e-3)


# ---------------------------------------------------------------------------------------------------------
# KeyboardInterrupt inside the CPU step (the worker thread)
def _interrupt_cpu_adam_at_call(monkeypatch: Any, n: int) -> dict[str, int]:
    real = ops_module.cpu_adamw_step_
    calls = {"n": 0}

    def interrupted(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        real(*args, **kwargs)

    monkeypatch.setattr(ops_module, "cpu_adamw_step_", interrupted)
    return calls


@pytest.mark.parametrize("rollback", ["double_buffer", "inverse"])
def test_keyboard_interrupt_in_the_speculative_cpu_step_restores_the_state(rel: Any, monkeypatch: Any,
                                                                           rollback: str) -> None:
    threads_before = rel.worker_threads()
    model = tiny_llama()
    opt = rel.optimizer(model, max_grad_norm=None, config=rel.CFG.replace(rollback=rollback))
    ours = rel.worker_threads() - threads_before
    rel.train(model, opt, rel.batches(2))
    assert opt.engine.governor.speculate_next()
    before = rel.snapshot(model, opt)
    _interrupt_cpu_adam_at_call(monkeypatch, 3)  # the third bucket's speculative step, during backward
    ids = rel.batches(1, seed=9)[0]
    t0 = time.perf_counter()
    with pytest.raises(WorkerError) as info:
        model(input_ids=ids, labels=ids).loss.backward()
        # make the failure land before validation (a slow worker would otherwise fail after it: see below)
        rel.wait_until(lambda: opt.engine._worker.failed, what="the worker to fail")
        opt.step()
    assert time.perf_counter() - t0 < 10
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert not opt.engine.step_in_progress
    rel.assert_same_state(before, rel.snapshot(model, opt, sync=False), exact=rollback == "double_buffer")
    if rollback == "double_buffer":
        assert opt.engine.consistent  # the committed copy is never written by a step: always intact
    # inverse: the failed bucket was stepped in place; the injected failure wrote nothing, but a real one may
    # have, so the engine may (conservatively) refuse to checkpoint: proposed fix (B) does
    opt.close()
    for t in ours:
        t.join(timeout=10)
        assert not t.is_alive()


def test_after_a_rolled_back_worker_failure_a_new_optimizer_continues_from_state_dict(rel: Any,
                                                                                      monkeypatch: Any) -> None:
    data = rel.batches(4)
    model = tiny_llama()
    opt = rel.optimizer(model, max_grad_norm=None)
    rel.train(model, opt, data[:2])
    _interrupt_cpu_adam_at_call(monkeypatch, 3)
    with pytest.raises(WorkerError):
        model(input_ids=data[2], labels=data[2]).loss.backward()
        rel.wait_until(lambda: opt.engine._worker.failed, what="the worker to fail")
        opt.step()
    monkeypatch.undo()
    assert opt.engine.consistent
    opt.close()
    sd = opt.state_dict()
    opt.zero_grad()
    new = rel.optimizer(model, max_grad_norm=None)
    new.load_state_dict(sd)
    rel.train(model, new, data[2:])
    ref_model = tiny_llama()
    ref = rel.optimizer(ref_model, max_grad_norm=None)
    rel.train(ref_model, ref, data)
    rel.assert_same_state(rel.snapshot(ref_model, ref), rel.snapshot(model, new))


def test_keyboard_interrupt_in_the_cpu_step_after_validation_refuses_checkpoints(rel: Any, monkeypatch: Any) -> None:
    """Without speculation the CPU step runs after validation: a failure there leaves a half-applied step,
    which the engine marks inconsistent, so no checkpoint of it can be written."""
    model = tiny_llama()
    opt = rel.optimizer(model, config=rel.CFG.replace(speculation=False))
    rel.train(model, opt, rel.batches(1))
    _interrupt_cpu_adam_at_call(monkeypatch, 2)
    ids = rel.batches(1, seed=9)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # validated; the CPU work runs after this returns
    with pytest.raises(WorkerError) as info:
        model(input_ids=ids, labels=ids)  # the next forward waits for its buckets and sees the failure
    assert isinstance(info.value.__cause__, KeyboardInterrupt)
    assert not opt.engine.consistent
    with pytest.raises((WorkerError, RuntimeError)):
        opt.state_dict()


# ---------------------------------------------------------------------------------------------------------
# KeyboardInterrupt in the training thread inside step(), after the verdict was published
def test_keyboard_interrupt_in_step_after_validation_is_undone_or_blocks_checkpoints(rel: Any,
                                                                                     monkeypatch: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model, max_grad_norm=None)
    rel.train(model, opt, rel.batches(2))
    before = rel.snapshot(model, opt)

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(device_tail, "adamw_flat_", interrupted)
    ids = rel.batches(1, seed=9)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises((KeyboardInterrupt, WorkerError)):
        opt.step()
    monkeypatch.undo()
    if opt.engine.consistent:
        rel.assert_same_state(before, rel.snapshot(model, opt))
    else:
        with pytest.raises(RuntimeError, match="inconsistent"):
            opt.state_dict()


def test_optimizer_threads_are_daemons() -> None:
    """A worker thread never keeps the interpreter alive (Ctrl-C / end of script exits even without close())."""
    model = tiny_llama()
    before = {t for t in threading.enumerate() if t.name.startswith("superoffload")}
    opt = SuperOffloadOptimizer(model, lr=1e-3, log_plan=False)
    try:
        ours = {t for t in threading.enumerate() if t.name.startswith("superoffload")} - before
        assert ours and all(t.daemon for t in ours)
    finally:
        opt.close()
