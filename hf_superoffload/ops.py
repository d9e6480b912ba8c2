"""Typed entry points of the CPU Adam kernels.

The engine calls only these. They dispatch to the compiled ``cpu_ext`` op library when it is
available and to the eager-torch twin (:mod:`hf_superoffload.cpu_ext.reference`) otherwise.
"""

from __future__ import annotations

import torch

from .cpu_ext import reference as _reference

__all__ = ["backend", "cpu_adamw_step_", "cpu_adamw_undo_"]


def backend() -> str:
    """Name of the implementation the ops dispatch to."""
    return "reference"


def cpu_adamw_step_(
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
    backup: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_threads: int | None = None,
) -> None:
    """One ``torch.optim.AdamW`` step, in place, on contiguous fp32 ``param``/``exp_avg``/``exp_avg_sq``.

    Args:
        grad: fp32 or bf16 gradient, multiplied by ``grad_scale`` inside the pass (the clip coefficient).
        step: the step count *after* this update (1 on the first step).
        param_bf16_out: receives the bf16 copy of the updated parameter in the same pass.
        backup: three fp32 tensors that receive the pre-step (param, exp_avg, exp_avg_sq).
        num_threads: threads for this call; ``None`` uses the library default.
    """
    del num_threads
    _reference.adamw_step_(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, grad_scale=grad_scale, param_bf16_out=param_bf16_out, backup=backup,
    )


def cpu_adamw_undo_(
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
    num_threads: int | None = None,
) -> None:
    """Algebraic inverse of :func:`cpu_adamw_step_` with the same arguments (fp32-rounding exact)."""
    del num_threads
    _reference.adamw_undo_(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, grad_scale=grad_scale, param_bf16_out=param_bf16_out,
    )
