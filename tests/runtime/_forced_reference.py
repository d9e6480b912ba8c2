"""A reference optimizer fed the very gradients our model produced, and a tolerance at the rounding floor.

``ReferenceAdamW`` on its own model drifts from ours as soon as one bf16 weight rounds the other way (Adam then
amplifies the flip), which forces loose, lr-sized tolerances. Fed our gradients instead (captured by tensor hooks
before autograd accumulates them, summed in the dtype the engine sums them in), torch's AdamW + clip_grad_norm_
on fp32 masters follows the same trajectory, and the only differences left are fp32 roundings: of the Adam
arithmetic (a few per step) and of the clip coefficient's reduction order. ``hf_superoffload.testing.
rounding_floor_ratio`` holds them to that floor; a wrong lr, decay, eps, bias correction, clip coefficient or
gradient moves values by >= 1e-4 relative: 10^3 times the bound.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_superoffload.testing import ReferenceAdamW, rounding_floor_ratio, tiny_llama

LR, EPS = 1e-3, 1e-6  # a non-default eps: an engine path that falls back to torch's default eps shows


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Decay on matrices; no decay, another lr and other betas on norms (every knob differs per group)."""
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": 2 * LR, "betas": (0.8, 0.95)}]


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


class ForcedReference(ReferenceAdamW):
    """``ReferenceAdamW`` on a twin of ``ours`` whose gradients are those ``ours`` received.

    ``accumulate_in``: dtype of the micro-batch sum (bf16: autograd's ``.grad`` accumulation on the device; fp32:
    the engine's fp32 host accumulation).
    """

    def __init__(self, ours: torch.nn.Module, *, max_grad_norm: float | None,
                 accumulate_in: torch.dtype = torch.bfloat16) -> None:
        self.twin = tiny_llama(seed=0)
        self.twin.load_state_dict(ours.state_dict())
        super().__init__(self.twin, groups(self.twin), max_grad_norm=max_grad_norm, lr=LR, eps=EPS,
                         weight_decay=0.1)
        self.accumulate_in = accumulate_in
        self.captured: dict[str, torch.Tensor] = {}
        self._name = {id(p): n for n, p in self.twin.named_parameters()}
        for n, p in ours.named_parameters():
            p.register_hook(lambda g, n=n: self._capture(n, g))

    def _capture(self, name: str, grad: torch.Tensor) -> None:
        g = grad.detach().to(self.accumulate_in)
        prev = self.captured.get(name)
        self.captured[name] = g.clone() if prev is None else prev + g

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        g = self.captured.get(self._name[id(p)])
        return None if g is None else g.float()

    def step(self) -> None:
        super().step()
        self.captured.clear()

    def set_lr(self, scale: float) -> None:
        self.opt.param_groups[0]["lr"], self.opt.param_groups[1]["lr"] = LR * scale, 2 * LR * scale


def assert_at_rounding_floor(ours: torch.nn.Module, opt: Any, ref: ForcedReference, steps: int) -> float:
    """Masters, moments and step counts of every parameter within the bound; the bf16 weights exactly the
    round-to-nearest-even of our masters. Returns the worst error as a fraction of the bound."""
    opt.synchronize()
    eng = opt.engine
    flat = eng.flat_state()
    name = {id(p): n for n, p in ours.named_parameters()}
    masters = {ref._name[id(p)]: m for p, m in ref.pairs}
    worst = 0.0
    for i, p in enumerate(eng.params):
        pl, off = eng.param_location(i)
        side = "host" if pl.value == "host" else "device"
        m = masters[name[id(p)]]
        st = ref.opt.state.get(m, {})
        assert eng.param_steps[i] == int(st.get("step", 0)), f"{name[id(p)]}: step count"
        for kind, want in (("master", m), ("exp_avg", st.get("exp_avg")), ("exp_avg_sq", st.get("exp_avg_sq"))):
            got = flat[side][kind][off : off + p.numel()].view(p.shape)
            if want is None:
                continue
            ratio = rounding_floor_ratio(got, want, steps=steps)
            worst = max(worst, ratio)
            assert ratio <= 1.0, f"{name[id(p)]} {kind}: off by {ratio:.3g} times the rounding bound"
        master = flat[side]["master"][off : off + p.numel()].view(p.shape)
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), f"{name[id(p)]}: bf16 weights != RNE(master)"
    return worst
