"""Bad input: a plan that does not fit in host RAM, invalid or unsupported options, and unusual models.

Config validation itself is in tests/unit/test_config_and_planner.py::test_config_rejects_bad_values_with_the_fix;
tied weights, parameters without gradients and fp32 conversion are in tests/runtime/test_parity.py.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import re
from typing import Any

import pytest
import torch
from torch import nn

from hf_superoffload import SuperOffloadConfig, SuperOffloadOptimizer
from hf_superoffload.planning.hardware import HardwareProfile
from hf_superoffload.planning.planner import PlanError
from hf_superoffload.testing import ReferenceAdamW, tiny_llama

GiB = 1024**3
MiB = 1024**2


# ---------------------------------------------------------------------------------------------------------
# host RAM
def test_plan_that_does_not_fit_in_host_ram_is_refused_before_allocating(rel: Any) -> None:
    # ~5M fp32 parameters: accepted, this plan would allocate ~140 MB of host state (28 B/param) and convert the
    # model to bf16. The profile says only 2 GiB of host RAM are available (< the state plus the 2 GiB headroom).
    model = tiny_llama(seed=0, dtype=torch.float32, vocab_size=1024, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=4)
    n = sum(p.numel() for p in model.parameters())
    assert n > 4_000_000
    profile = HardwareProfile(device_type="cpu", device_free_bytes=None, host_available_bytes=2 * GiB, cpu_threads=1)
    threads = rel.worker_threads()
    gc.collect()
    rss0 = rel.rss_bytes()
    with pytest.raises(PlanError) as info:
        SuperOffloadOptimizer(model, lr=1e-3, config=SuperOffloadConfig(gpu_resident_buckets=0), profile=profile)
    gc.collect()
    grown = rel.rss_bytes() - rss0
    msg = str(info.value)
    need = n * 16 / GiB
    assert f"needs {need:.1f} GiB (16 B/param for {n / 1e9:.2f}B parameters) plus 2 GiB kept free" in msg
    assert "only 2.0 GiB of host RAM is available" in msg
    assert "gpu_resident_buckets" in msg  # what to change
    assert grown < 16 * MiB, f"host RSS grew by {grown / MiB:.0f} MiB before the refusal"
    # nothing was started or changed: no worker, no hooks, the fp32 model is still fp32
    assert rel.worker_threads() == threads
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_an_8b_model_on_a_64_gib_host_is_refused_with_the_numbers() -> None:
    """Planning needs only the sizes: a meta-device Llama-8B shows the real message, with nothing allocated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    profile = HardwareProfile(device_type="cuda", device_free_bytes=80 * GiB, host_available_bytes=64 * GiB,
                              cpu_threads=15)
    with pytest.raises(PlanError, match=r"needs 119\.7 GiB \(16 B/param for 8\.03B parameters\) plus 6 GiB kept free "
                                        r"\(headroom, the engine's own RSS\), but only 64\.0 GiB of host RAM is "
                                        r"available\. Keep more buckets on the GPU"):
        SuperOffloadOptimizer(model, lr=1e-5, config=SuperOffloadConfig(gpu_resident_buckets=0), profile=profile)


def _frontier_case() -> tuple[Any, Any, Any, int]:
    """A tiny model, a workload of batch 8 x 512 and a pretend device budget that holds batch 3 but not 4."""
    from hf_superoffload.planning.planner import Workload, device_holds, make_plan
    from hf_superoffload.testing import pretend_profile

    model = tiny_llama(seed=0, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    numels = [p.numel() for p in model.parameters()]

    def fits(batch: int, budget: int) -> bool:
        w = Workload(model.config, batch, 512, grad_ckpt=False, chunked_loss=True)
        plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=pretend_profile(budget),
                         workload=w)
        return device_holds(plan, w, pretend_profile(budget), 1)[0]

    lo, hi = 1 * MiB, 64 * GiB  # the smallest budget that holds batch 3
    while hi - lo > MiB:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(3, mid) else (mid, hi)
    assert fits(3, hi) and not fits(4, hi)
    return model, Workload(model.config, 8, 512, grad_ckpt=False), pretend_profile(hi), hi


def test_a_workload_that_fits_no_plan_is_refused_with_the_frontier(rel: Any) -> None:
    """[Note: refused with the frontier]: not an out-of-memory error in the first forward, but the PlanError at
    construction, naming the largest batch and the longest sequence that fit (the search's own), before anything is
    converted, hooked or started."""
    model, workload, profile, _ = _frontier_case()
    threads = rel.worker_threads()
    with pytest.raises(PlanError) as info:
        SuperOffloadOptimizer(model, lr=1e-3, workload=workload, profile=profile)
    msg = str(info.value)
    assert "8 x 512 tokens per step does not fit this device with any plan" in msg
    assert "the largest that fit: batch 3 at 512 tokens or " in msg
    seq = int(re.search(r" or (\d+) tokens at batch 8", msg).group(1))  # type: ignore[union-attr]
    from hf_superoffload.planning.planner import device_holds, make_plan

    numels = [p.numel() for p in model.parameters()]
    for n, ok in ((seq, True), (seq + 1, False)):
        w = dataclasses.replace(workload, seq_len=n, chunked_loss=True)
        plan = make_plan(numels, element_size=2, config=SuperOffloadConfig(), profile=profile, workload=w)
        assert device_holds(plan, w, profile, 1)[0] is ok, n
    assert "Use a smaller batch or shorter sequences, turn on gradient checkpointing" in msg
    assert "\n" not in msg
    assert rel.worker_threads() == threads
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert not any(m._forward_pre_hooks for m in model.modules())
    # a setting the user fixed is named: leaving it to the search may be what fits
    with pytest.raises(PlanError, match=r"leave gpu_resident_buckets to 'auto' \(the search then weighs it\)"):
        SuperOffloadOptimizer(model, lr=1e-3, workload=workload, profile=profile,
                              config=SuperOffloadConfig(gpu_resident_buckets=1))


def test_a_first_batch_that_fits_no_plan_is_refused_before_its_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bare optimizer plans at the first training batch: a batch no plan holds is refused there, with the
    frontier, before its forward runs or the engine exists."""
    from hf_superoffload.planning import hardware

    model, workload, profile, budget = _frontier_case()
    monkeypatch.setattr(hardware.HardwareProfile, "read", classmethod(lambda cls, device: profile))
    opt = SuperOffloadOptimizer(model, lr=1e-3, log_plan=False)
    assert not opt.planned
    before = [p.detach().clone() for p in model.parameters()]
    ran: list[int] = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: ran.append(1))
    with pytest.raises(PlanError, match=r"8 x 512 tokens per step does not fit .* batch 3 at 512 tokens"):
        model(input_ids=torch.zeros(8, 512, dtype=torch.long), labels=torch.zeros(8, 512, dtype=torch.long))
    assert not ran and not opt.planned
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.close()


# ---------------------------------------------------------------------------------------------------------
# options
@pytest.mark.parametrize("option", ["amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused"])
def test_unsupported_adamw_options_are_refused_by_name(option: str) -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match=rf"does not support {option}=True; drop the argument"):
        SuperOffloadOptimizer(model, lr=1e-3, **{option: True})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_falsy_unsupported_options_are_accepted_and_unknown_ones_refused(rel: Any) -> None:
    model = tiny_llama()
    rel.optimizer(model, amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                  fused=None).close()
    with pytest.raises(TypeError, match="unexpected argument 'momentum'"):
        SuperOffloadOptimizer(model, lr=1e-3, momentum=0.9)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lr": -1.0}, "lr=-1.0 is invalid: use a learning rate >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\) are invalid: both must lie in \[0, 1\)"),
        ({"eps": 0.0}, "eps=0.0 is invalid: use a small positive number"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 is invalid: use a value >= 0"),
        ({"max_grad_norm": -1.0}, r"max_grad_norm=-1.0 is invalid: use None/0 \(off\) or a positive norm"),
    ],
)
def test_invalid_hyper_parameters_name_value_and_fix(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SuperOffloadOptimizer(tiny_llama(), **kw)


def test_invalid_config_names_field_value_and_fix() -> None:
    """One representative; every field: tests/unit/test_config_and_planner.py."""
    with pytest.raises(ValueError, match=r"SuperOffloadConfig.bucket_size_mb=0 is invalid: use .auto. or a positive size"):
        SuperOffloadConfig(bucket_size_mb=0)


def _bad_construction(case: str) -> tuple[Any, Any, type[Exception], str]:
    model = tiny_llama()
    if case == "params_first":
        return list(model.parameters()), None, TypeError, "takes the model first"
    if case == "foreign_param":
        return model, [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], ValueError, "must belong to the model"
    if case == "param_in_two_groups":
        p = model.lm_head.weight
        return model, [{"params": [p]}, {"params": [p]}], ValueError, "more than one parameter group"  # torch's
    if case == "frozen_param_passed":
        model.lm_head.weight.requires_grad_(False)
        return model, [model.lm_head.weight], ValueError, r"frozen parameters \(requires_grad=False\)"
    if case == "nothing_trainable":
        model.requires_grad_(False)
        return model, None, ValueError, "no trainable parameters"
    if case == "two_devices":
        model.lm_head.weight = nn.Parameter(torch.empty(128, 32, dtype=torch.bfloat16, device="meta"))
        return model, None, ValueError, "span devices.*move the model to one device"
    if case == "fp16_model":
        return tiny_llama(dtype=torch.float16), None, ValueError, "torch.float16 is not supported.*fp16 needs loss scaling"
    raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "params_first", "foreign_param", "param_in_two_groups", "frozen_param_passed", "two_devices", "fp16_model",
    pytest.param("nothing_trainable"),
])
def test_invalid_models_and_params_are_refused_clearly(case: str) -> None:
    model, params, exc, match = _bad_construction(case)
    with pytest.raises(exc, match=match):
        SuperOffloadOptimizer(model, params, lr=1e-3, log_plan=False)


# ---------------------------------------------------------------------------------------------------------
# unusual models
class _Unusual(nn.Module):
    """A transposed (non-contiguous) weight stored as a Parameter, BatchNorm running stats, a plain buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b_t = nn.Parameter(torch.randn(8, 16).t())  # [16, 8], strides (1, 16)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(torch.relu(self.a(x)) @ self.b_t) * self.scale


def test_non_contiguous_parameters_and_buffers_train_like_the_reference(rel: Any) -> None:
    ours = _Unusual().to(torch.bfloat16)
    ref = copy.deepcopy(ours)
    assert not ours.b_t.is_contiguous()
    opt = rel.optimizer(ours, lr=1e-2, config=SuperOffloadConfig(bucket_size_mb=0.004, gpu_resident_buckets=1))
    ropt = ReferenceAdamW(ref, lr=1e-2, weight_decay=0.01)
    assert len(opt.engine.params) == 5, "buffers are not optimized"
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        for model, o in ((ours, opt), (ref, ropt)):
            model(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert ours.b_t.stride() == (1, 16), "the parameter's layout was changed"
    for (name, p), (_, m) in zip(ours.named_parameters(), ropt.pairs):
        torch.testing.assert_close(rel.master_of(opt, p), m.detach(), rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), name
    for (name, b), r in zip(ours.named_buffers(), ref.buffers()):
        assert torch.equal(b, r), f"buffer {name} differs"
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_parameter_frozen_after_construction_is_not_stepped_and_resumes_when_unfrozen(rel: Any) -> None:
    ours, ref = tiny_llama(), tiny_llama()
    opt = rel.optimizer(ours, max_grad_norm=1.0)
    ropt = ReferenceAdamW(ref, max_grad_norm=1.0, lr=1e-3, weight_decay=0.01)

    def target(m: nn.Module) -> nn.Parameter:
        return m.model.layers[1].mlp.down_proj.weight

    def one_step(ids: torch.Tensor) -> None:
        for model, o in ((ours, opt), (ref, ropt)):
            model(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()

    data = rel.batches(6)
    for ids in data[:2]:
        one_step(ids)
    opt.synchronize()
    before_freeze = rel.state_of(opt, target(ours))
    for m in (ours, ref):
        target(m).requires_grad_(False)
    for ids in data[2:4]:
        one_step(ids)
    opt.synchronize()
    for k, v in rel.state_of(opt, target(ours)).items():
        assert torch.equal(v, before_freeze[k]), f"the frozen parameter's {k} changed"
    for m in (ours, ref):
        target(m).requires_grad_(True)
    for ids in data[4:]:
        one_step(ids)
    opt.synchronize()
    i = next(k for k, p in enumerate(opt.engine.params) if p is target(ours))
    ref_master = next(m for p, m in ropt.pairs if p is target(ref))
    assert opt.engine.param_steps[i] == int(ropt.opt.state[ref_master]["step"]) == 4
    assert max(opt.engine.param_steps) == 6
    # bf16 rounding may flip single weights over 6 steps (as in tests/runtime/test_parity.py): compare at 8 lr
    worst = max((rel.master_of(opt, p) - m.detach()).abs().max().item()
                for p, (_, m) in zip(ours.parameters(), ropt.pairs))
    assert worst < 8e-3


def test_parameter_added_after_construction_is_not_optimized(rel: Any) -> None:
    model = tiny_llama()
    opt = rel.optimizer(model)
    model.extra = nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="cannot add param groups after construction; build a new optimizer"):
        opt.add_param_group({"params": list(model.extra.parameters())})
    w0 = model.extra.weight.detach().clone()
    for ids in rel.batches(2):
        extra = model.extra(torch.ones(4, dtype=torch.bfloat16)).sum()
        (model(input_ids=ids, labels=ids).loss + extra).backward()
        opt.step()
        opt.zero_grad()
    # like torch.optim: a parameter the optimizer does not know is neither stepped nor zeroed
    assert torch.equal(model.extra.weight, w0)
    assert model.extra.weight.grad is not None
    assert all(p is not model.extra.weight for p in opt.engine.params)


def test_fp16_model_is_refused_with_the_reason_and_fp32_is_converted(rel: Any) -> None:
    """fp32 conversion in detail: tests/runtime/test_parity.py::test_fp32_model_is_converted_with_exact_masters."""
    with pytest.raises(ValueError, match=re.escape("fp16 needs loss scaling")):
        SuperOffloadOptimizer(tiny_llama(dtype=torch.float16), lr=1e-3, log_plan=False)
    model = tiny_llama(dtype=torch.float32)
    rel.optimizer(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
