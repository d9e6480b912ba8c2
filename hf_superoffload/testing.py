"""Test and benchmark helpers: tiny models and the plain reference optimizer we are judged against.

The reference recipe is what SuperOffloadOptimizer promises to equal up to fp32 rounding: bf16 weights for
compute, fp32 master copies, ``torch.nn.utils.clip_grad_norm_`` on the fp32 gradients, ``torch.optim.AdamW``
on the masters, and bf16 weights copied back from the masters after every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .planning.hardware import HardwareProfile

if TYPE_CHECKING:
    from .optimizer import SuperOffloadOptimizer
    from .runtime.telemetry import StepStats

__all__ = [
    "FP32_UNIT_ROUNDOFF", "ROUNDINGS_PER_STEP", "ReferenceAdamW", "TokenDataset", "TrainedStep", "master_of",
    "pretend_profile", "rounding_floor_ratio", "snapshot", "state_of", "state_tensors", "tiny_llama",
    "tiny_llama_config",
    "train_steps", "weights_and_state",
]


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", *,
               checkpointing: bool = False, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised few-layer Llama (no download), in training mode. Same ``seed`` gives the same
    weights; ``checkpointing`` checkpoints every decoder layer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(device=device, dtype=dtype)
    if checkpointing:  # transformers' new name where it has one (5.17, the oldest supported, has only the old one)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


def pretend_profile(device_free_bytes: int | None, *, host_available_bytes: int = 64 * 1024**3,
                    cpu_threads: int = 2, rates_of: str | None = None) -> HardwareProfile:
    """A CPU run's hardware profile that reports ``device_free_bytes`` free on the device, as a GPU would: what
    the planner sizes the tail and the kept layers from (``None``: unknown, as on a CPU). ``rates_of``: a shipped
    profile (e.g. ``"h200_pcie"``) whose GEMM, CPU Adam, link and memory rates it borrows, so that the roofline
    prices plans and the calibration times steps against them."""
    profile = HardwareProfile(device_type="cpu", device_free_bytes=device_free_bytes,
                              host_available_bytes=host_available_bytes, cpu_threads=cpu_threads)
    if rates_of is None:
        return profile
    src = HardwareProfile.shipped(rates_of)
    return dataclasses.replace(profile, matmul_tflops=src.matmul_tflops, cpu_adam_gparams=src.cpu_adam_gparams,
                               h2d_gbps=src.h2d_gbps, d2h_gbps=src.d2h_gbps, device_memory_gbps=src.device_memory_gbps,
                               host_memory_gbps=src.host_memory_gbps)


class TrainedStep(NamedTuple):
    """What :func:`train_steps` records of one optimizer step."""

    loss: float
    """The loss of the step's last micro-batch."""
    stats: StepStats
    """``opt.last_step_stats`` right after the step (a fresh object every step)."""


def train_steps(model: torch.nn.Module, opt: SuperOffloadOptimizer, batches: Iterable[torch.Tensor], *,
                accumulation: int = 1) -> list[TrainedStep]:
    """Train a causal LM on token-id batches (``input_ids`` == ``labels``): one ``opt.step()`` and
    ``opt.zero_grad()`` every ``accumulation`` batches, the micro-batches before the last of each step under
    ``opt.no_sync()``."""
    if accumulation < 1:
        raise ValueError(f"accumulation={accumulation}: use 1 or more micro-batches per step")
    batches = list(batches)
    out = []
    for k in range(0, len(batches), accumulation):
        micro = batches[k : k + accumulation]
        for ids in micro[:-1]:
            with opt.no_sync():
                model(input_ids=ids, labels=ids).loss.backward()
        loss = model(input_ids=micro[-1], labels=micro[-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(TrainedStep(loss.item(), opt.last_step_stats))
    return out


def state_tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts in key order, lists, tuples), depth first: what two optimizers'
    ``state_dict()`` are compared by."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in state_tensors(obj[k])]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in state_tensors(v)]
    return []


def weights_and_state(model: torch.nn.Module, opt: SuperOffloadOptimizer) -> list[torch.Tensor]:
    """Copies of the model's parameters and of every tensor of the optimizer's own state (``state_dict()``'s
    ``superoffload`` entry), after the CPU worker has finished: equal lists mean bit-identical training."""
    opt.synchronize()
    out = [p.detach().clone() for p in model.parameters()]
    return out + [t.clone() for t in state_tensors(opt.state_dict()["superoffload"])]


class ReferenceAdamW:
    """Plain mixed-precision AdamW: fp32 masters, ``clip_grad_norm_``, ``torch.optim.AdamW``.

    ``param_groups`` are given like torch's (dicts with ``params`` holding *model* parameters and options).
    """

    def __init__(self, model: torch.nn.Module, param_groups: Iterable[dict[str, Any]] | None = None, *,
                 max_grad_norm: float | None = None, **defaults: Any) -> None:
        if param_groups is None:
            param_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        groups = []
        seen: set[int] = set()
        for g in param_groups:
            masters = []
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                m = p.detach().float().clone().requires_grad_(True)
                self.pairs.append((p, m))
                masters.append(m)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        self.opt = torch.optim.AdamW(groups, foreach=False, **defaults)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")
        self.skipped_steps = 0

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The fp32 gradient ``step()`` uses for model parameter ``p`` (subclasses change where it comes from)."""
        return None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def step(self) -> None:
        grads = []
        for p, m in self.pairs:
            m.grad = self.grad_of(p)
            if m.grad is not None:
                grads.append(m.grad)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else \
            torch.tensor(0.0)
        self.last_grad_norm = float(norm)
        if not torch.isfinite(norm):
            self.skipped_steps += 1
        else:
            if self.max_grad_norm:
                torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs if m.grad is not None], self.max_grad_norm)
            self.opt.step()
            for p, m in self.pairs:
                p.copy_(m)
        for _, m in self.pairs:
            m.grad = None

    def zero_grad(self) -> None:
        for p, _ in self.pairs:
            p.grad = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups


FP32_UNIT_ROUNDOFF = 2.0**-24
ROUNDINGS_PER_STEP = 4
"""Roundings of a compared value per step that may differ from torch's when the reference is fed our gradients
(fp32 Adam arithmetic in another order, the clip coefficient's reduction order). Measured on the unmutated engine:
the worst element stays below 1/20 of the bound; every mutation of tests/mutation exceeds it by orders of
magnitude."""


def rounding_floor_ratio(got: torch.Tensor, want: torch.Tensor, *, steps: int) -> float:
    """The worst ``|got - want|`` as a fraction of the fp32 rounding floor after ``steps`` optimizer steps.

    The floor is ``ROUNDINGS_PER_STEP * steps * u * scale``, u = 2**-24 the fp32 unit roundoff and ``scale`` the
    compared value's magnitude: its own plus its tensor's mean magnitude (for values that cancel to ~0, like a
    first moment). It binds only against a reference fed the very gradients our model received (a reference on
    its own model drifts by whole bf16 flips that Adam amplifies); then a wrong lr, decay, eps, bias correction,
    clip coefficient or gradient moves values by >= 1e-4 relative, 10^3 times the floor. ``<= 1`` passes.
    """
    got, want = got.detach().float(), want.detach().float()
    scale = want.abs() + want.abs().mean()
    bound = ROUNDINGS_PER_STEP * steps * FP32_UNIT_ROUNDOFF * scale + torch.finfo(torch.float32).tiny
    return float(((got - want).abs() / bound).max())


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token blocks (``input_ids`` == ``labels``) for :func:`tiny_llama`'s vocabulary,
    deterministic for ``seed``: what the Trainer tests train on."""

    def __init__(self, n: int = 32, seq: int = 16, seed: int = 1, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def state_of(opt: SuperOffloadOptimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies on the CPU of the committed fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` of model parameter
    ``param``, wherever the plan put it (one process; callers synchronize first)."""
    eng = opt.engine
    i = next(k for k, p in enumerate(eng.params) if p is param)
    placement, off = eng.param_location(i)
    flat = eng.flat_state()["host" if placement.value == "host" else "device"]
    return {k: flat[k][off : off + param.numel()].view(param.shape).cpu().clone()
            for k in ("master", "exp_avg", "exp_avg_sq")}


def master_of(opt: SuperOffloadOptimizer, param: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU of the committed fp32 master of model parameter ``param`` (see :func:`state_of`)."""
    return state_of(opt, param)["master"]


def snapshot(model: torch.nn.Module, opt: SuperOffloadOptimizer) -> dict[str, Any]:
    """A deep copy of ``model``'s and ``opt``'s state dicts taken through ``torch.save`` (what a checkpoint holds),
    to start a reference run from the state at some point of another."""
    import io

    opt.synchronize()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
