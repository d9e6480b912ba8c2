"""The D2H gate ([Note: D2H gate] in docs/design.md).

With a D2H lead the backward queues a host bucket's first CPU task while its gradient copy may still be in flight.
With ``plan.d2h_gate`` a gate thread waits for the copy and only then queues the task, so the worker runs other
ready work (a deferred commit) instead of blocking. On CPU the copy is synchronous, so these tests make the gate's
wait slow on purpose: the run must equal the ungated run BITWISE (the gate moves when a task starts, never what it
computes), and every first task must have passed through the gate thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.planner import make_plan
from hf_superoffload.runtime import streams
from hf_superoffload.testing import tiny_llama

from .test_upload_thread import snapshot, train

GiB = 1024**3


def build(config: SuperOffloadConfig, clip: float | None) -> tuple[torch.nn.Module, SuperOffloadOptimizer]:
    model = tiny_llama(seed=0)
    opt = SuperOffloadOptimizer(model, lr=1e-3, weight_decay=0.1, max_grad_norm=clip, config=config, log_plan=False)
    return model, opt


def test_the_planner_gates_only_with_a_lead_in_one_process() -> None:
    hw = HardwareProfile(device_type="cuda", device_free_bytes=80 * GiB, host_available_bytes=120 * GiB,
                         cpu_threads=15)
    numels = [1 << 20] * 64
    everything_on_host = SuperOffloadConfig(gpu_resident_buckets=0)

    def plan(config: SuperOffloadConfig, **kw: Any) -> Any:
        return make_plan(numels, element_size=2, config=config, profile=hw, **kw)

    p = plan(everything_on_host)
    assert p.d2h_lead_buckets == 4 and p.d2h_gate
    assert "each queued once its copy has landed" in p.summary()
    assert not plan(everything_on_host.with_overrides(d2h_gate=False)).d2h_gate
    assert not plan(everything_on_host.with_overrides(d2h_lead_buckets=0)).d2h_gate
    assert not plan(everything_on_host, world_size=2, rank=0).d2h_gate
    with pytest.raises(ValueError, match="d2h_gate"):
        PlannerOverrides(d2h_gate="yes")  # type: ignore[arg-type]


# (options, planner overrides besides the D2H lead)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "speculative": ({}, {}),
    "clip_every_step_defer_master": ({"cast_side": "cpu"}, {"defer_moments": True, "defer_master": True}),
    "no_speculation": ({"speculation": False}, {}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gated_runs_equal_ungated_runs_bitwise(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = 0.05 if name == "clip_every_step_defer_master" else 1.0  # 0.05: clipping fires on every step
    options, overrides = CONFIGS[name]
    config = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=1, worker_timeout_s=60,
                                overrides=PlannerOverrides(d2h_lead_buckets=2, **overrides), **options)
    model_a, opt_a = build(config.with_overrides(d2h_gate=False), clip)
    assert not opt_a.plan.d2h_gate
    losses_a = train(model_a, opt_a, 6)
    state_a = snapshot(model_a, opt_a)
    opt_a.close()

    gated: list[str] = []
    real_wait = streams.Handoff.wait_host

    def slow_copy(self: Any) -> None:
        if threading.current_thread().name.endswith("-gate"):
            gated.append(threading.current_thread().name)
            time.sleep(0.002)  # a copy still in flight: the worker may run anything else meanwhile
        real_wait(self)

    monkeypatch.setattr(streams.Handoff, "wait_host", slow_copy)
    model_b, opt_b = build(config, clip)
    assert opt_b.plan.d2h_gate
    losses_b = train(model_b, opt_b, 6)
    state_b = snapshot(model_b, opt_b)
    opt_b.close()

    assert losses_a == losses_b
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), f"{k} differs with the D2H gate"
    assert len(gated) == 6 * len(opt_b.engine.host_buckets) and set(gated) == {"superoffload-cpu-gate"}


def test_a_first_task_released_after_the_verdict_still_commits_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle-commit chain is queued by ``step()``; a gated first task released after that (its copy landed
    late) may find the chain past its bucket. Its deferred moments must still be stored by the idle worker, not
    left for the bucket's next task (found by a stress run: 27 of 30 steps left commits pending)."""
    real_wait = streams.Handoff.wait_host

    def late_copy(self: Any) -> None:
        if threading.current_thread().name.endswith("-gate"):
            time.sleep(0.005)
        real_wait(self)

    monkeypatch.setattr(streams.Handoff, "wait_host", late_copy)
    config = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=1, speculation=False, cast_side="cpu",
                                worker_timeout_s=60, overrides=PlannerOverrides(d2h_lead_buckets=2, defer_moments=True))
    model, opt = build(config, 1.0)
    assert opt.plan.d2h_gate and opt.plan.defer_moments
    g = torch.Generator().manual_seed(3)
    pending = []
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()  # drains the worker: the idle commits included
        pending.append(opt.engine.pending_moment_commits)
    opt.close()
    assert pending == [0, 0, 0, 0]
