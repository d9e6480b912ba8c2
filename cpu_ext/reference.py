"""Eager-torch twin of the CPU Adam ops: the test oracle and the fallback when no compiler is present.

Math follows ``torch.optim.AdamW`` (decoupled weight decay, bias correction):

    g   = grad * grad_scale                      (fp32)
    p   = p * (1 - lr * weight_decay)
    m   = beta1 * m + (1 - beta1) * g
    v   = beta2 * v + (1 - beta2) * g * g
    p   = p - (lr / (1 - beta1**step)) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

``step`` is the 1-based count *after* this update, as in torch; lr, beta1, beta2, eps and weight_decay arrive as
one ``hyper`` (:class:`AdamWHyper`, [Note: one AdamW signature] in ``_hyper.py``). With ``source`` the step is out
of place: the pre-step state is read from ``source`` and the new state written to ``param``/``exp_avg``/
``exp_avg_sq``.

With ``store_moments=False`` the step updates ``param`` (and its bf16 copy) from the new moments without storing
them; :func:`adamw_moments_` stores them later from the same pre-step moments and gradient, with the same
operations ([Note: deferred moment stores] in ``csrc/kernels_common.h``). With ``store_master=False`` as well (and a
``param_bf16_out``) the step writes only the bf16 copy of the updated parameter; a later full step on the same
pre-step state and gradient commits p, m and v.
"""

from __future__ import annotations

import math

import torch

from ._hyper import AdamWHyper, require_hyper

__all__ = ["adamw_moments_", "adamw_step_", "adamw_undo_", "check_source", "check_store_flags"]

_STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")


def _check(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor, got {t.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad must be float32 or bfloat16, got {grad.dtype}")
    if not (param.numel() == grad.numel() == exp_avg.numel() == exp_avg_sq.numel()):
        raise ValueError("param, grad, exp_avg and exp_avg_sq must have the same number of elements")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def check_source(
    dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    others: dict[str, torch.Tensor | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate an out-of-place ``source`` for ``dst`` = (param, exp_avg, exp_avg_sq).

    Returns the (destination, source) pairs whose memory differs: a source with its destination's data
    pointer is read in place. A source partially overlapping its destination, or sharing memory with any
    other destination, ``others`` (grad, the bf16 copy) or another source, raises ``ValueError``.
    """
    if source is None:
        return []
    if len(source) != 3:
        raise ValueError(f"source must be three tensors (param, exp_avg, exp_avg_sq), got {len(source)}")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    named: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in zip(_STATE_NAMES, dst)]
    named += [(n, t) for n, t in (others or {}).items() if t is not None]
    for name, d, s in zip(_STATE_NAMES, dst, source):
        if s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"src_{name} must be a contiguous float32 tensor, got {s.dtype}")
        if s.numel() != d.numel():
            raise ValueError(f"src_{name} has {s.numel()} elements, expected {d.numel()} (as {name})")
        if s.data_ptr() == d.data_ptr():
            continue
        if _overlaps(s, d):
            raise ValueError(
                f"src_{name} partially overlaps {name}: pass the same tensor for an in-place step or disjoint "
                "memory for an out-of-place one"
            )
        for other_name, t in named:
            if _overlaps(s, t):
                raise ValueError(f"src_{name} and {other_name} must not share memory")
        named.append((f"src_{name}", s))
        pairs.append((d, s))
    return pairs


def check_store_flags(store_moments: bool, store_master: bool, param_bf16_out: torch.Tensor | None) -> None:
    """``store_master=False`` writes the bf16 copy only: it needs ``store_moments=False`` and ``param_bf16_out``.

    The messages are those of the compiled op (``ValueError`` there too).
    """
    if store_master:
        return
    if store_moments:
        raise ValueError(
            "store_master=False requires store_moments=False (a step that stores neither p nor m/v writes only "
            "the bf16 copy; the state is committed by a later full step): pass store_moments=False or "
            "store_master=True"
        )
    if param_bf16_out is None:
        raise ValueError(
            "store_master=False requires param_bf16_out (the bf16 copy is the only output of such a step): pass "
            "param_bf16_out or store_master=True"
        )


def _others(grad: torch.Tensor, param_bf16_out: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    return {"grad": grad, "param_bf16_out": param_bf16_out}


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float | torch.Tensor = 1.0,
    param_bf16_out: torch.Tensor | None = None,
    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    store_moments: bool = True,
    store_master: bool = True,
) -> None:
    """One AdamW step, in place or (``source`` = pre-step (param, exp_avg, exp_avg_sq)) out of place.

    ``store_moments=False``: ``exp_avg``/``exp_avg_sq`` are not written (see :func:`adamw_moments_`).
    ``store_master=False`` (with ``store_moments=False`` and ``param_bf16_out``): ``param`` is not written either,
    only the bf16 copy.
    """
    _check(param, grad, exp_avg, exp_avg_sq)
    require_hyper(hyper)
    check_store_flags(store_moments, store_master, param_bf16_out)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this update), got {step}")
    for dst, src in check_source((param, exp_avg, exp_avg_sq), source, _others(grad, param_bf16_out)):
        if store_moments or (dst is param and store_master):
            dst.view(-1).copy_(src.view(-1))
    g = _scaled(grad, grad_scale)
    if store_master:
        p = param.view(-1)
    else:  # the new parameter in a temporary
        p = (source[0] if source is not None else param).reshape(-1).clone()
    if store_moments:
        m, v = exp_avg.view(-1), exp_avg_sq.view(-1)
    else:  # the new moments in temporaries
        src_m, src_v = (source[1], source[2]) if source is not None else (exp_avg, exp_avg_sq)
        m, v = src_m.reshape(-1).clone(), src_v.reshape(-1).clone()
    bc1 = hyper.bias_correction1(step)
    bc2_sqrt = math.sqrt(hyper.bias_correction2(step))
    p.mul_(1.0 - hyper.lr * hyper.weight_decay)
    _moments(g, m, v, hyper)
    denom = (v.sqrt() / bc2_sqrt).add_(hyper.eps)
    p.addcdiv_(m, denom, value=-(hyper.lr / bc1))
    if param_bf16_out is not None:
        param_bf16_out.view(-1).copy_(p)


def _scaled(grad: torch.Tensor, grad_scale: float | torch.Tensor) -> torch.Tensor:
    g = grad.view(-1).to(torch.float32)
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    return g


def _moments(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hyper: AdamWHyper) -> None:
    """The moment update, in place (the step and :func:`adamw_moments_` share it)."""
    m.lerp_(g, 1.0 - hyper.beta1)
    v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)


def adamw_moments_(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    hyper: AdamWHyper,
    grad_scale: float | torch.Tensor = 1.0,
    source: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store the moments of a step taken with ``store_moments=False``: ``exp_avg``/``exp_avg_sq`` := m_t, v_t from
    the pre-step moments (in place, or read from ``source`` = (exp_avg, exp_avg_sq)) and the step's gradient and
    ``hyper`` (only its betas matter)."""
    _check(exp_avg, grad, exp_avg, exp_avg_sq)
    require_hyper(hyper)
    if source is not None:
        if len(source) != 2:
            raise ValueError(f"source must be two tensors (exp_avg, exp_avg_sq), got {len(source)}")
        # validated as a step's source whose param is read in place (the param slot is a dummy)
        for dst, src in check_source((exp_avg.new_empty(0), exp_avg, exp_avg_sq), (exp_avg.new_empty(0), *source),
                                     {"grad": grad}):
            dst.view(-1).copy_(src.view(-1))
    _moments(_scaled(grad, grad_scale), exp_avg.view(-1), exp_avg_sq.view(-1), hyper)


def adamw_undo_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float = 1.0,
    param_bf16_out: torch.Tensor | None = None,
) -> None:
    """Invert :func:`adamw_step_` algebraically (exact up to fp32 rounding, not bitwise).

    ``step`` and ``hyper`` are those the step was taken with.
    """
    _check(param, grad, exp_avg, exp_avg_sq)
    require_hyper(hyper)
    g = _scaled(grad, grad_scale)
    p, m, v = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    bc1 = hyper.bias_correction1(step)
    bc2_sqrt = math.sqrt(hyper.bias_correction2(step))
    denom = (v.sqrt() / bc2_sqrt).add_(hyper.eps)
    p.addcdiv_(m, denom, value=hyper.lr / bc1)
    decay = 1.0 - hyper.lr * hyper.weight_decay
    if decay != 1.0:
        p.div_(decay)
    m.sub_(g * (1.0 - hyper.beta1)).div_(hyper.beta1)
    v.sub_(g * g * (1.0 - hyper.beta2)).div_(hyper.beta2).clamp_(min=0.0)
    if param_bf16_out is not None:
        param_bf16_out.view(-1).copy_(p)
