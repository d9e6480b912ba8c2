"""[Note: kept layers]: under per-layer checkpointing the plan spends device memory the offload leaves free on
decoder layers that keep their activations. The memory model and the roofline count them, the planner keeps as
many as the device holds, the optimizer applies them to the model before the first forward's layers run (and
gives them back for a later, longer batch), and training is bit-identical to checkpointing every layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.plan_cli import resolve_profile
from hf_superoffload.planning.memory_model import ModelShape, PlanLike, estimate
from hf_superoffload.planning.planner import Workload, device_holds, make_plan
from hf_superoffload.planning.step_time import predict_step_time
from hf_superoffload.runtime.kept_layers import KeptLayers, checkpointed_layers, layer_checkpointing
from hf_superoffload.testing import pretend_profile, tiny_llama, train_steps

LAYERS = 6
BATCH, SEQ = 8, 96  # enough tokens that the activations, not the buckets, set the tiny model's peak


def _model(ckpt: bool = True) -> torch.nn.Module:
    return tiny_llama(seed=3, num_hidden_layers=LAYERS, checkpointing=ckpt)


def _budget(model: torch.nn.Module, kept: float) -> int:
    """A device budget that holds every optimizer state on the device and ``kept`` (fractional) kept layers."""
    n, k = sum(p.numel() for p in model.parameters()), int(kept)
    need = [estimate(model.config, batch_size=BATCH, seq_len=SEQ, grad_ckpt=True, chunked_loss=True,
                     plan_like=PlanLike(device_numel=n, kept_layers=j)).gpu_required_bytes for j in (k, k + 1)]
    return int((need[0] + (kept - k) * (need[1] - need[0])) / (1 - 0.04))


def _train(opt: SuperOffloadOptimizer, model: torch.nn.Module, steps: int, seq: int = SEQ) -> list[float]:
    """The loss of every step, the CPU worker finished after the last."""
    g = torch.Generator().manual_seed(7)
    losses = [step.loss for step in train_steps(model, opt, [torch.randint(0, 128, (BATCH, seq), generator=g)
                                                             for _ in range(steps)])]
    opt.synchronize()
    return losses


# ------------------------------------------------------------------------------------------------ the model
def test_memory_model_counts_each_kept_layer_once() -> None:
    shape = ModelShape.from_config("8b")
    tokens = 4 * 2048
    per_layer = (shape.layer_activation_bytes_per_token() - 2 * shape.hidden_size) * tokens
    kw = dict(batch_size=4, seq_len=2048, grad_ckpt=True, chunked_loss=True)
    base = estimate(shape, plan_like=PlanLike(device_numel=shape.numel), **kw)
    for k in (1, 7, 32):
        est = estimate(shape, plan_like=PlanLike(device_numel=shape.numel, kept_layers=k), **kw)
        for phase in ("loss", "backward_start"):
            grown = sum(est.gpu_phases[phase].values()) - sum(base.gpu_phases[phase].values())
            assert grown == k * per_layer, (phase, k)
    # every layer kept is checkpointing off
    off = estimate(shape, plan_like=PlanLike(device_numel=shape.numel), **{**kw, "grad_ckpt": False})
    all_kept = estimate(shape, plan_like=PlanLike(device_numel=shape.numel, kept_layers=32), **kw)
    assert sum(all_kept.gpu_phases["loss"].values()) == sum(off.gpu_phases["loss"].values())


def test_roofline_saves_the_kept_layers_recompute() -> None:
    shape = ModelShape.from_config("8b")
    profile = resolve_profile("h200", gpu_mem_gb=None, host_mem_gb=None)
    kw = dict(batch_size=4, seq_len=2048)
    full = predict_step_time(shape, PlanLike(device_numel=shape.numel), profile, grad_ckpt=True, **kw)
    half = predict_step_time(shape, PlanLike(device_numel=shape.numel, kept_layers=16), profile, grad_ckpt=True, **kw)
    none = predict_step_time(shape, PlanLike(device_numel=shape.numel), profile, grad_ckpt=False, **kw)
    every = predict_step_time(shape, PlanLike(device_numel=shape.numel, kept_layers=32), profile, grad_ckpt=True, **kw)
    assert full and half and none and every
    assert none.gpu_s < half.gpu_s < full.gpu_s
    assert every.gpu_s == pytest.approx(none.gpu_s) and every.backward_window_s == pytest.approx(none.backward_window_s)


@pytest.mark.parametrize("flag", [True, False])
def test_planner_keeps_the_most_layers_the_device_holds(flag: bool) -> None:
    model = _model()
    budget = _budget(model, 3.5)
    numels = [p.numel() for p in model.parameters()]
    workload = Workload(model.config, BATCH, SEQ, grad_ckpt=True, chunked_loss=True, layer_checkpointing=flag)
    cfg = SuperOffloadConfig(bucket_size_mb=0.01)
    plan = make_plan(numels, element_size=2, config=cfg, profile=pretend_profile(budget), workload=workload)
    if not flag:
        assert plan.kept_layers == 0
        return
    assert 0 < plan.kept_layers < LAYERS
    assert device_holds(plan, workload, pretend_profile(budget), 1)[0]
    assert not device_holds(dataclasses.replace(plan, kept_layers=plan.kept_layers + 1), workload, pretend_profile(budget), 1)[0]
    assert "keep their activations" in plan.summary()
    # no kept layers where they would not apply
    for w, prof in ((dataclasses.replace(workload, grad_ckpt=False), pretend_profile(budget)),
                    (dataclasses.replace(workload, keep_attention=True), pretend_profile(budget)),
                    (workload, pretend_profile(None))):
        assert make_plan(numels, element_size=2, config=cfg, profile=prof, workload=w).kept_layers == 0
    flow = make_plan(numels, element_size=2, config=cfg.replace(weight_placement="flow"), profile=pretend_profile(budget),
                     workload=workload)
    assert flow.kept_layers == 0


# ------------------------------------------------------------------------------------------------ the runtime
def test_kept_layers_object() -> None:
    model = _model()
    layers = checkpointed_layers(model)
    assert len(layers) == LAYERS and layer_checkpointing(model)
    kept = KeptLayers(layers, 2)
    assert [m.gradient_checkpointing for m in layers] == [True] * (LAYERS - 2) + [False] * 2
    kept.set(1)
    assert [m.gradient_checkpointing for m in layers] == [True] * (LAYERS - 1) + [False]
    layers[0].gradient_checkpointing = False  # the user's own change: left alone
    kept.restore()
    assert [m.gradient_checkpointing for m in layers] == [False] + [True] * (LAYERS - 1)
    with pytest.raises(ValueError, match="use 0 to 6"):
        KeptLayers(layers, 7)
    assert not layer_checkpointing(_model(ckpt=False))


def test_training_with_kept_layers_is_bit_identical_and_close_restores(device_budget, monkeypatch) -> None:
    import hf_superoffload.optimizer as optimizer_module

    runs = {}
    device_budget(_budget(_model(), 3.5))
    for name in ("kept", "checkpointed"):
        if name == "checkpointed":  # the same plan with every layer checkpointed
            monkeypatch.setattr(optimizer_module, "layer_checkpointing", lambda model: False)
        model = _model()
        opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
        flags: list[list[bool]] = []
        model.register_forward_pre_hook(lambda m, a, flags=flags: flags.append([x.gradient_checkpointing
                                                                                for x in m.model.layers]))
        losses = _train(opt, model, 4)
        runs[name] = (losses, [p.detach().clone() for p in model.parameters()], opt.plan.kept_layers, flags)
        opt.close()
        assert all(x.gradient_checkpointing for x in model.model.layers)  # the model as the user had it
    losses, weights, kept, flags = runs["kept"]
    assert 0 < kept < LAYERS
    # applied before the first forward's layers ran (the hook above runs after the optimizer's plan hook)
    assert flags[0] == [True] * (LAYERS - kept) + [False] * kept
    assert runs["checkpointed"][2] == 0
    assert losses == runs["checkpointed"][0]
    assert all(torch.equal(a, b) for a, b in zip(weights, runs["checkpointed"][1], strict=True))


def test_a_longer_batch_checkpoints_kept_layers_again_instead_of_failing(device_budget) -> None:
    model = _model()
    device_budget(_budget(model, 5.5))
    opt = SuperOffloadOptimizer(model, lr=1e-2, max_grad_norm=1.0, log_plan=False)
    _train(opt, model, 1)
    kept = opt.plan.kept_layers
    assert kept >= 2
    _train(opt, model, 1, seq=SEQ + SEQ // 4)  # a few more tokens: fewer kept layers fit
    assert 0 <= opt.plan.kept_layers < kept
    assert [x.gradient_checkpointing for x in model.model.layers].count(False) == opt.plan.kept_layers
    assert opt.last_step_stats.verdict in ("commit", "redo")
    opt.close()
