"""The step-time roofline over gradient accumulation ([Note: step-time roofline] in planning/step_time.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hf_superoffload.demo.presets import llama_config
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.memory_model import ModelShape, PlanLike
from hf_superoffload.planning.step_time import (
    ACCUMULATE_ADD_BYTES,
    ACCUMULATE_DRAM_EFFICIENCY,
    predict_step_time,
)

H200 = HardwareProfile.h200_pcie()
SHAPE_8B = ModelShape.from_config(llama_config("8b"))
CAP_ROW = PlanLike(host_numel=7_261_646_848, weight_mode="flow", host_accumulation="landing")
"""The 24 GiB-cap 8B row's plan: every state on the host, weights streamed, bf16 landing adds."""


def step(plan_like: PlanLike, micro_batches: int, profile: HardwareProfile = H200):
    st = predict_step_time(SHAPE_8B, plan_like, profile, batch_size=4, seq_len=2048, grad_ckpt=True,
                           clipping_every_step=True, micro_batches=micro_batches)
    assert st is not None
    return st


def test_one_micro_batch_is_the_step_as_before():
    for plan_like in (CAP_ROW, PlanLike(host_numel=3_000_000_000, device_numel=5_000_000_000)):
        one = step(plan_like, 1)
        assert one.step_s == pytest.approx(one.gpu_s + one.tail_s + one.exposed_s)


def test_on_device_accumulation_repeats_the_gpu_work():
    stationary = PlanLike(host_numel=3_000_000_000, device_numel=5_000_000_000)
    one, eight = step(stationary, 1), step(stationary, 8)
    assert eight.micro_batch_s == pytest.approx(one.gpu_s)
    assert eight.step_s == pytest.approx(one.step_s + 7 * one.gpu_s)


def test_host_accumulation_under_flow_is_bound_by_host_memory():
    st = step(CAP_ROW, 8)
    dram = CAP_ROW.host_numel * (ACCUMULATE_ADD_BYTES["landing"] + 2 + 2) / (
        H200.host_memory_gbps * 1e9 * ACCUMULATE_DRAM_EFFICIENCY)
    assert dram > st.backward_window_s  # the adds, not the GPU, bound this backward
    fetch = 2 * CAP_ROW.host_numel / (H200.h2d_gbps * 1e9)
    assert st.micro_batch_s == pytest.approx(max(st.forward_window_s, fetch) + dram)
    # the measured row (11.045 s, median of 5) the efficiency was fitted on
    assert st.step_s == pytest.approx(11.045, rel=0.03)
    # an fp32 arena moves 4 B/param more per add; more host bandwidth makes it the GPU's again
    assert step(dataclasses.replace(CAP_ROW, host_accumulation="fp32"), 8).micro_batch_s > st.micro_batch_s
    fast = dataclasses.replace(H200, host_memory_gbps=10 * H200.host_memory_gbps)
    assert step(CAP_ROW, 8, fast).micro_batch_s == pytest.approx(max(st.forward_window_s, fetch) + st.backward_window_s)


def test_micro_batches_must_be_positive():
    with pytest.raises(ValueError, match="micro_batches=0"):
        step(CAP_ROW, 0)
