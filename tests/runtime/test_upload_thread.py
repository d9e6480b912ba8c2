"""The upload thread ([Note: upload thread] in docs/design.md).

With ``plan.upload_thread`` the CPU worker hands each finished host bucket's H2D upload to a thread of its own and
goes on to the next bucket's Adam. The planner turns it on for CUDA only; these CPU tests force it on the plan, so
the same tasks run (on CPU the "upload" is the scatter into the parameters) and the thread hand-off, its ordering
against the next forward and its failure handling are exercised. A run with the thread must equal the run without
it BITWISE (the upload moves bits, it computes nothing), and a failed upload must surface in the training thread.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch

import hf_superoffload.optimizer as optimizer_module
from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload import state as st
from hf_superoffload.config import PlannerOverrides
from hf_superoffload.runtime import upload
from hf_superoffload.runtime.cpu_worker import WorkerError
from hf_superoffload.testing import tiny_llama

LR = 1e-3


@pytest.fixture
def force_upload_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans get ``upload_thread=True`` even on CPU (the planner keeps it for CUDA)."""
    real = optimizer_module.make_plan

    def make_plan(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        return dataclasses.replace(plan, upload_thread=plan.host_numel > 0)

    monkeypatch.setattr(optimizer_module, "make_plan", make_plan)


def build(config: SuperOffloadConfig, clip: float | None) -> tuple[torch.nn.Module, SuperOffloadOptimizer]:
    model = tiny_llama(seed=0)
    opt = SuperOffloadOptimizer(model, lr=LR, weight_decay=0.1, max_grad_norm=clip, config=config, log_plan=False)
    return model, opt


def train(model: torch.nn.Module, opt: SuperOffloadOptimizer, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model: torch.nn.Module, opt: SuperOffloadOptimizer) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()["superoffload"]  # synchronizes: every upload has landed
    out = {f"{side}/{k}": st._whole(t).detach().clone() for side in ("host", "device") for k, t in sd[side].items()}
    out.update({f"model/{n}": p.detach().clone() for n, p in model.named_parameters()})
    return out


CONFIGS = {
    "speculative": dict(),
    "clip_every_step_defer_master": dict(
        cast_side="cpu", overrides=PlannerOverrides(defer_moments=True, defer_master=True)),
    "speculation_off_inverse": dict(speculation=False, rollback="inverse"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_runs_with_and_without_the_upload_thread_are_bitwise_equal(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = 0.05 if name == "clip_every_step_defer_master" else 1.0  # 0.05: clipping fires on every step
    config = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=1, worker_timeout_s=60, **CONFIGS[name])
    model_a, opt_a = build(config.with_overrides(upload_thread=False), clip)
    assert opt_a.engine.uploads.thread is None
    losses_a = train(model_a, opt_a, 6)
    state_a = snapshot(model_a, opt_a)
    opt_a.close()

    uploads: list[tuple[Any, str]] = []
    real_upload = upload.Uploads.upload

    def recording_upload(self: Any, b: Any, copy: int) -> None:
        uploads.append((self, threading.current_thread().name))  # any engine still alive in this process
        real_upload(self, b, copy)

    monkeypatch.setattr(upload.Uploads, "upload", recording_upload)
    real = optimizer_module.make_plan
    monkeypatch.setattr(optimizer_module, "make_plan",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), upload_thread=True))
    model_b, opt_b = build(config, clip)
    assert opt_b.engine.uploads.thread is not None
    losses_b = train(model_b, opt_b, 6)
    state_b = snapshot(model_b, opt_b)
    opt_b.close()

    assert losses_a == losses_b
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), f"{k} differs with the upload thread"
    threads = [name for up, name in uploads if up is opt_b.engine.uploads]
    assert threads and set(threads) == {"superoffload-upload"}, f"uploads ran on {sorted(set(threads))}"
    assert len(threads) == 6 * len(opt_b.engine.host_buckets)


def test_a_failed_upload_reaches_the_training_thread_and_marks_the_state_inconsistent(
        force_upload_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    config = SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=1, worker_timeout_s=60)
    model, opt = build(config, None)
    train(model, opt, 2)
    real_upload = upload.Uploads.upload

    def failing_upload(self: Any, b: Any, copy: int) -> None:
        if threading.current_thread().name == "superoffload-upload":
            raise RuntimeError("injected H2D failure")
        real_upload(self, b, copy)

    monkeypatch.setattr(upload.Uploads, "upload", failing_upload)
    with pytest.raises(WorkerError, match="upload of") as info:
        train(model, opt, 2)  # the step queues the uploads; the next forward (or step) meets the failure
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not opt.engine.consistent  # the device weights of a validated step are not all there
    with pytest.raises(WorkerError):
        opt.engine.synchronize()


def test_a_hand_built_plan_with_the_upload_thread_and_streamed_weights_is_refused(monkeypatch: pytest.MonkeyPatch):
    """The planner keeps the upload thread for stationary weights; the engine refuses a plan that says otherwise
    (streamed weights have no upload to hand off) before it allocates anything."""
    real = optimizer_module.make_plan
    monkeypatch.setattr(optimizer_module, "make_plan",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), upload_thread=True))
    config = SuperOffloadConfig(bucket_size_mb=0.004, weight_placement="flow", gpu_resident_buckets=0)
    with pytest.raises(ValueError, match="upload thread is single-process with stationary weights"):
        build(config, 1.0)
