"""The D2H lead in the step-time roofline ([Note: D2H lead] in docs/design.md): with no lead each host bucket's hook
waits for its own gradient copy, so the copies run beside an idle GPU instead of under the backward."""

from __future__ import annotations

import dataclasses

import pytest

from hf_superoffload.demo.presets import llama_config
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.memory_model import ModelShape, PlanLike
from hf_superoffload.planning.step_time import predict_step_time

H200 = HardwareProfile.h200_pcie()
SHAPE_8B = ModelShape.from_config(llama_config("8b"))


def step(plan_like: PlanLike, micro_batches: int = 1):
    st = predict_step_time(SHAPE_8B, plan_like, H200, batch_size=4, seq_len=2048, grad_ckpt=True,
                           clipping_every_step=True, micro_batches=micro_batches)
    assert st is not None
    return st


@pytest.mark.parametrize("host", [1_573_957_632, 3_042_021_376, 8_030_000_000])
def test_no_lead_exposes_every_host_gradient_copy(host: int):
    lead = PlanLike(host_numel=host, device_numel=8_030_000_000 - host, d2h_lead_buckets=4)
    led, drained = step(lead), step(dataclasses.replace(lead, d2h_lead_buckets=0))
    copies = 2 * host / (H200.d2h_gbps * 1e9)  # the bf16 gradients' D2H
    assert drained.d2h_s == pytest.approx(copies)
    # a lead hides the copies under the backward (as much of them as its window holds); without one none is hidden
    hidden = min(copies, led.backward_window_s)
    assert drained.exposed_s - led.exposed_s == pytest.approx(hidden)
    assert drained.step_s - led.step_s == pytest.approx(hidden)


def test_no_host_state_or_a_summed_flush_has_nothing_to_drain():
    on_device = PlanLike(device_numel=8_030_000_000)
    assert step(on_device).step_s == step(dataclasses.replace(on_device, d2h_lead_buckets=4)).step_s
    # host accumulation's ring slots bound its copies; the limiter (and its drain) does not apply to them
    summed = PlanLike(host_numel=4_000_000_000, device_numel=4_030_000_000, host_accumulation="landing")
    assert step(summed, 8).step_s == step(dataclasses.replace(summed, d2h_lead_buckets=4), 8).step_s
