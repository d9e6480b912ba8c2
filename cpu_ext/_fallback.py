"""Torch implementations used when the op library cannot be built (see ``_build``).

The step runs ``torch._fused_adamw_`` (torch's vectorised CPU AdamW) with the bf16->fp32 gradient upcast
and the fp32->bf16 weight cast as separate passes (and, out of place, a copy of the source into the
destination first); the undo and anything torch lacks use ``reference``.
These run on torch's intra-op threads: ``num_threads`` is ignored here.
"""

from __future__ import annotations

import dataclasses

import torch

from . import reference
from ._hyper import AdamWHyper, require_hyper

__all__ = ["adamw_moments_", "adamw_step_", "grad_sumsq_nonfinite"]

_SUMSQ_BLOCK = 1 << 16  # the compiled op's fixed blocks (kSumsqBlockElems) ...
_SUMSQ_LANES = 32  # ... and lanes (kSumsqLanes)
_SUMSQ_CHUNK = 1 << 22  # elements per fp64 temporary (32 MiB, three of them), a whole number of blocks


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float = 1.0,
    param_bf16_out: torch.Tensor | None = None,
    source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    store_moments: bool = True,
    store_master: bool = True,
) -> None:
    """Same contract as ``ops.cpu_adamw_step_``, in several torch passes.

    ``store_moments=False`` steps on copies of the moments (an extra 8 B/param of temporaries: a fallback);
    ``store_master=False`` on a copy of the parameter too (4 B/param more), then writes only the bf16 copy.
    """
    fused = getattr(torch, "_fused_adamw_", None)
    if fused is None:
        reference.adamw_step_(
            param, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale,
            param_bf16_out=param_bf16_out, source=source, store_moments=store_moments, store_master=store_master,
        )
        return
    reference._check(param, grad, exp_avg, exp_avg_sq)
    require_hyper(hyper)
    reference.check_store_flags(store_moments, store_master, param_bf16_out)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this update), got {step}")
    others = {"grad": grad, "param_bf16_out": param_bf16_out}
    for dst, src in reference.check_source((param, exp_avg, exp_avg_sq), source, others):
        if store_moments or (dst is param and store_master):
            dst.view(-1).copy_(src.view(-1))  # the out-of-place step as a copy pass, then in place
    if store_master:
        p = param.view(-1)
    else:  # scratch copy: only the bf16 copy below is written
        p = (source[0] if source is not None else param).reshape(-1).clone()
    if store_moments:
        m, v = exp_avg.view(-1), exp_avg_sq.view(-1)
    else:
        src_m, src_v = (source[1], source[2]) if source is not None else (exp_avg, exp_avg_sq)
        m, v = src_m.reshape(-1).clone(), src_v.reshape(-1).clone()
    _fused(fused, p, _scaled(grad, grad_scale), m, v, step=step, hyper=hyper)
    if param_bf16_out is not None:
        param_bf16_out.view(-1).copy_(p)  # the separate cast pass


def _scaled(grad: torch.Tensor, grad_scale: float) -> torch.Tensor:
    g = grad.view(-1)
    if g.dtype != torch.float32:
        g = g.to(torch.float32)  # the separate upcast pass
        if grad_scale != 1.0:
            g.mul_(grad_scale)
    elif grad_scale != 1.0:
        g = g * grad_scale
    return g


def _fused(fused, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,  # type: ignore[no-untyped-def]
           hyper: AdamWHyper) -> None:
    state_step = torch.tensor(float(step), dtype=torch.float32)
    fused(
        [p], [g], [m], [v], [], [state_step], lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2,
        weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False, maximize=False,
    )


def adamw_moments_(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    hyper: AdamWHyper,
    grad_scale: float = 1.0,
    source: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Same contract as ``ops.cpu_adamw_moments_``: the moments of ``torch._fused_adamw_`` (the step's own
    kernel, on a scratch parameter), so they equal those of a fallback step with ``store_moments=True`` bit for bit."""
    fused = getattr(torch, "_fused_adamw_", None)
    if fused is None:
        reference.adamw_moments_(grad, exp_avg, exp_avg_sq, hyper=hyper, grad_scale=grad_scale, source=source)
        return
    reference._check(exp_avg, grad, exp_avg, exp_avg_sq)
    require_hyper(hyper)
    if source is not None:
        if len(source) != 2:
            raise ValueError(f"source must be two tensors (exp_avg, exp_avg_sq), got {len(source)}")
        empty = exp_avg.new_empty(0)
        for dst, src in reference.check_source((empty, exp_avg, exp_avg_sq), (empty, *source), {"grad": grad}):
            dst.view(-1).copy_(src.view(-1))
    scratch = torch.zeros(exp_avg.numel(), dtype=torch.float32)  # the moments do not depend on p, lr or step
    moments_only = dataclasses.replace(hyper, lr=0.0, eps=1e-8, weight_decay=0.0)
    _fused(fused, scratch, _scaled(grad, grad_scale), exp_avg.view(-1), exp_avg_sq.view(-1), step=1,
           hyper=moments_only)


def grad_sumsq_nonfinite(grad: torch.Tensor) -> tuple[float, int]:
    """Sum of squares (fp64 accumulation) and count of inf/NaN elements, in bounded fp64 chunks.

    The compiled op's order, bit for bit ([Note: fixed-order sums] in cpu_ext/csrc/kernels_common.h): blocks of
    ``_SUMSQ_BLOCK`` elements, in each block 32 lanes (lane k adds the squares of elements k, k + 32, ... in index
    order: a per-column ``cumsum``, which torch runs sequentially), the lanes summed by a fixed halving tree, the
    blocks' sums added in block order. ``torch.sum`` instead splits by torch's thread count.
    """
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad must be float32 or bfloat16, got {grad.dtype}")
    flat = grad.reshape(-1)
    sumsq = 0.0
    nonfinite = 0
    for start in range(0, flat.numel(), _SUMSQ_CHUNK):
        chunk = flat[start : start + _SUMSQ_CHUNK]
        nonfinite += int((~torch.isfinite(chunk)).sum())
        squares = chunk.to(torch.float64).square()
        pad = -squares.numel() % _SUMSQ_BLOCK  # +0 leaves a lane as it was
        squares = torch.nn.functional.pad(squares, (0, pad)).view(-1, _SUMSQ_BLOCK // _SUMSQ_LANES, _SUMSQ_LANES)
        lanes = squares.cumsum(dim=1)[:, -1, :].clone()
        w = _SUMSQ_LANES // 2
        while w >= 1:
            lanes[:, :w] += lanes[:, w : 2 * w]
            w //= 2
        for block_sum in lanes[:, 0].tolist():
            sumsq += block_sum
    return sumsq, nonfinite
