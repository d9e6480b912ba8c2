"""Torch implementations used when the op library cannot be built (see ``_build``).

The step runs ``torch._fused_adamw_`` (torch's vectorised CPU AdamW) with the bf16->fp32 gradient upcast
and the fp32->bf16 weight cast as separate passes (and, out of place, a copy of the source into the
destination first); the undo and anything torch lacks use ``reference``.
These run on torch's intra-op threads: ``num_threads`` is ignored here.
"""

from __future__ import annotations

import torch

from . import reference

__all__ = ["adamw_step_", "grad_sumsq_nonfinite"]

_SUMSQ_CHUNK = 1 << 24  # elements per fp64 temporary (128 MiB)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    param_bf16_out: torch.Tensor | None = None,
    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Same contract as ``ops.cpu_adamw_step_``, in several torch passes."""
    fused = getattr(torch, "_fused_adamw_", None)
    if fused is None:
        reference.adamw_step_(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, grad_scale=grad_scale, param_bf16_out=param_bf16_out, source=source,
        )
        return
    reference._check(param, grad, exp_avg, exp_avg_sq)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this update), got {step}")
    others = {"grad": grad, "param_bf16_out": param_bf16_out}
    for dst, src in reference.check_source((param, exp_avg, exp_avg_sq), source, others):
        dst.view(-1).copy_(src.view(-1))  # the out-of-place step as a copy pass, then in place
    p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g = grad.view(-1)
    if g.dtype != torch.float32:
        g = g.to(torch.float32)  # the separate upcast pass
        if grad_scale != 1.0:
            g.mul_(grad_scale)
    elif grad_scale != 1.0:
        g = g * grad_scale
    state_step = torch.tensor(float(step), dtype=torch.float32)
    fused(
        [p], [g], [m], [v], [], [state_step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
        eps=eps, amsgrad=False, maximize=False,
    )
    if param_bf16_out is not None:
        param_bf16_out.view(-1).copy_(p)  # the separate cast pass


def grad_sumsq_nonfinite(grad: torch.Tensor) -> tuple[float, int]:
    """Sum of squares (fp64 accumulation) and count of inf/NaN elements, in bounded fp64 chunks."""
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad must be float32 or bfloat16, got {grad.dtype}")
    flat = grad.reshape(-1)
    sumsq = 0.0
    nonfinite = 0
    for start in range(0, flat.numel(), _SUMSQ_CHUNK):
        chunk = flat[start : start + _SUMSQ_CHUNK]
        sumsq += float(chunk.to(torch.float64).square().sum())
        nonfinite += int((~torch.isfinite(chunk)).sum())
    return sumsq, nonfinite
