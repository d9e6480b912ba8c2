"""``StepStats.pass_s``: the wall time of the host pass that ran in an iteration, from the last verdict until the
CPU worker had finished every host bucket of that step; and the Trainer/Accelerate telemetry window that averages
it (with the moment commits and the master share, which it used to report as 0)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload import ops as ops_module
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.integrations._common import TelemetryWindow
from hf_superoffload.runtime.engine import StepStats
from hf_superoffload.testing import tiny_llama

SLEEP_S = 0.01


def run(steps: int, *, nan_at: frozenset[int] = frozenset(), **config: Any) -> tuple[list[StepStats], Any]:
    g = torch.Generator().manual_seed(0)
    model = tiny_llama(seed=0)
    cfg = SuperOffloadConfig(**({"bucket_size_mb": 0.004, "gpu_resident_buckets": 0, "speculation": False} | config))
    opt = SuperOffloadOptimizer(model, lr=1e-3, max_grad_norm=1e-3, config=cfg, log_plan=False)
    stats = []
    for k in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        (loss * float("nan") if k in nan_at else loss).backward()
        opt.step()
        opt.zero_grad()
        stats.append(opt.last_step_stats)
    return stats, opt


@pytest.fixture
def slow_adam(monkeypatch):
    """Every CPU Adam call of a pass sleeps a little: the pass takes at least that long per host bucket."""
    real = ops_module.cpu_adamw_step_

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(SLEEP_S)
        real(*args, **kwargs)

    monkeypatch.setattr(ops_module, "cpu_adamw_step_", slow)


@pytest.mark.parametrize("defer_moments", [False, True])
def test_the_pass_is_timed_from_the_verdict_to_its_last_bucket(slow_adam, defer_moments: bool) -> None:
    stats, opt = run(4, overrides=PlannerOverrides(defer_moments=defer_moments))
    n_host = len(opt.engine.host_buckets)
    opt.close()
    assert stats[0].pass_s == 0.0  # no pass before the first step
    for k, st in enumerate(stats[1:], 1):
        # the last step's pass: one slowed Adam call per host bucket at least, and within the iteration
        assert st.pass_s >= n_host * SLEEP_S * 0.9, f"step {k}: {st.pass_s} for {n_host} host buckets"
        assert st.pass_s <= st.iteration_s, f"step {k}"
        assert st.as_log()["superoffload/pass_s"] == round(st.pass_s, 4)


def test_no_pass_follows_a_skipped_step() -> None:
    stats, opt = run(4, nan_at=frozenset({1}))
    opt.close()
    assert [st.verdict for st in stats] == ["redo", "skip", "redo", "redo"]
    assert stats[1].pass_s > 0  # step 0's pass
    assert stats[2].pass_s == 0.0  # the skipped step had none
    assert stats[3].pass_s > 0


def test_the_telemetry_window_averages_commits_passes_and_the_split() -> None:
    window = TelemetryWindow()
    for k in range(4):
        window.add(StepStats(cpu_s=0.5, commit_s=0.2 + 0.1 * k, pass_s=0.4, wait_s=0.1, master_deferred_buckets=2 * k,
                             moment_deferred_buckets=10 - k))
    stats, opt = run(1)
    logs = window.as_log(opt)
    opt.close()
    assert logs["superoffload/moment_commit_s"] == pytest.approx(0.35)
    assert logs["superoffload/pass_s"] == pytest.approx(0.4)
    assert logs["superoffload/master_deferred_buckets"] == 3.0
    assert logs["superoffload/moment_deferred_buckets"] == 8.0  # the mean of 10, 9, 8, 7, rounded half to even
    assert logs["superoffload/cpu_adam_s"] == pytest.approx(0.5)


def test_a_window_of_one_step_logs_that_step() -> None:
    """Every counter the window averages comes out of a one-step window as the step itself logs it."""
    from dataclasses import fields

    values = {f.name: (k + 1) * (3 if f.type == "int" else 0.125) for k, f in enumerate(fields(StepStats))
              if f.type in ("int", "float") and f.name != "grad_norm"}
    step = StepStats(**values, speculative=True)
    window = TelemetryWindow()
    window.add(step)
    stats, opt = run(1)
    logs = window.as_log(opt)
    opt.close()
    assert logs | step.as_log() == logs  # every key of the step's own log, with its value
    assert logs["superoffload/iteration_s"] == step.iteration_s
    assert logs["superoffload/wasted_buckets"] == step.wasted_buckets


class _Mark:
    """A CUDA timing event as ``Telemetry`` reads it: done or not, and milliseconds since another."""

    def __init__(self, at_ms: float, done: bool = True) -> None:
        self.at_ms, self.done = at_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: _Mark) -> float:
        return other.at_ms - self.at_ms


def test_the_gpu_idle_gap_of_a_wait_counts_once_the_gpu_has_passed_it() -> None:
    """[Note: idle inside a wait]: each wait's gap between its two events is idle time, counted at the ``step()``
    after the GPU passed the wait's end; a wait the GPU has not reached yet counts in a later iteration."""
    from hf_superoffload.runtime.telemetry import Telemetry

    t = Telemetry()
    t.add(wait_s=0.9)
    t.mark_gpu_wait(_Mark(100.0), _Mark(350.0))  # idle 250 ms
    pending = _Mark(600.0, done=False)
    t.mark_gpu_wait(_Mark(590.0), pending)  # the GPU is still short of this wait's end
    first = t.take()
    assert first.wait_s == 0.9 and first.gpu_idle_s == pytest.approx(0.25)
    pending.done = True
    second = t.take()
    assert second.wait_s == 0.0 and second.gpu_idle_s == pytest.approx(0.01)
    assert t.take().gpu_idle_s == 0.0  # counted once
    assert first.overlap == 1.0  # no CPU Adam seconds in this iteration: nothing to hide
