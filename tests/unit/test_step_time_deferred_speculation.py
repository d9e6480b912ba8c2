"""The step-time roofline counts deferred speculation's commits ([Note: step-time roofline] in
planning/step_time.py, [Note: deferred speculation] in docs/design.md): a speculative pass of 16 instead of 28
B/param, and a 26 B/param commit per committed speculative step, exposed only where the worker's idle time cannot
hold it."""

from __future__ import annotations

import dataclasses

import pytest

from hf_superoffload import SuperOffloadConfig
from hf_superoffload.demo.presets import llama_config
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.memory_model import ModelShape, PlanLike
from hf_superoffload.planning.step_time import predict_step_time
from hf_superoffload.testing import tiny_llama

H200 = HardwareProfile.h200_pcie()
SHAPE_8B = ModelShape.from_config(llama_config("8b"))
ALL_HOST = PlanLike(host_numel=8_000_000_000)
"""Every state on the host: the CPU pass outlasts the GPU's step, and so would the commits."""
SMALL_HOST = PlanLike(host_numel=1_000_000_000, device_numel=7_000_000_000)
"""A host share whose pass and commits fit beside the GPU's step."""


def step(plan_like: PlanLike, profile: HardwareProfile = H200, *, clipping_every_step: bool = False):
    st = predict_step_time(SHAPE_8B, plan_like, profile, batch_size=4, seq_len=2048, grad_ckpt=True,
                           clipping_every_step=clipping_every_step)
    assert st is not None
    return st


def test_the_commit_is_counted_and_hidden_while_it_fits_the_idle_time():
    eager, deferred = step(SMALL_HOST), step(dataclasses.replace(SMALL_HOST, deferred_speculation=True))
    rate = H200.cpu_adam_gparams * 1e9
    assert eager.commit_s == 0.0
    assert deferred.commit_s == pytest.approx(26 / 28 * SMALL_HOST.host_numel / rate)
    assert deferred.cpu_s == pytest.approx(16 / 28 * eager.cpu_s)
    idle = deferred.forward_window_s + deferred.backward_window_s - deferred.cpu_s
    assert deferred.commit_s <= idle  # fits: nothing of it is exposed, and the shorter pass is not slower
    assert deferred.step_s <= eager.step_s


def test_a_commit_that_does_not_fit_is_exposed():
    eager = step(ALL_HOST)
    deferred = step(dataclasses.replace(ALL_HOST, deferred_speculation=True))
    idle = max(0.0, deferred.forward_window_s + deferred.backward_window_s - deferred.cpu_s)
    spill = deferred.commit_s - idle
    assert spill > 0
    # the same step with the commit left out: its spill is what the prediction adds
    no_commit = dataclasses.replace(deferred, exposed_s=deferred.exposed_s - spill, step_s=deferred.step_s - spill)
    assert no_commit.step_s < eager.step_s < deferred.step_s  # a shorter pass, but more bytes in all


def test_clipping_every_step_pauses_speculation_so_nothing_is_owed():
    a = step(dataclasses.replace(ALL_HOST, deferred_speculation=True), clipping_every_step=True)
    assert a.commit_s == 0.0 and a.step_s == step(ALL_HOST, clipping_every_step=True).step_s


def test_the_plan_carries_it_to_the_roofline():
    from hf_superoffload import SuperOffloadOptimizer

    for rollback, want in (("inverse", True), ("double_buffer", False)):
        model = tiny_llama(seed=0)
        opt = SuperOffloadOptimizer(model, lr=1e-3, config=SuperOffloadConfig(bucket_size_mb=0.004, rollback=rollback))
        try:
            assert opt.plan.deferred_speculation is want
            assert PlanLike.from_plan(opt.plan).deferred_speculation is want
        finally:
            opt.close()
