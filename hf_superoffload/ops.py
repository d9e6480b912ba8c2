"""Typed entry points of the CPU Adam kernels.

The engine calls only these. They dispatch to the compiled ``cpu_ext`` op library (built on first use,
see [Note: CPU Adam build] in ``cpu_ext/_build.py``) and to a torch fallback when it cannot be built.
Each AdamW entry point takes its hyper-parameters as one ``hyper=AdamWHyper(...)`` ([Note: one AdamW signature] in
``cpu_ext/_hyper.py``); the op schemas take scalars, converted here.
"""

from __future__ import annotations

import os

import torch

from .cpu_ext import _fallback
from .cpu_ext._build import load_library
from .cpu_ext._hyper import AdamWHyper, require_hyper

__all__ = [
    "AdamWHyper",
    "affinity_cores",
    "backend",
    "cpu_adamw_moments_",
    "cpu_adamw_step_",
    "cpu_adamw_undo_",
    "default_num_threads",
    "grad_sumsq_nonfinite",
]


def affinity_cores() -> int:
    """Cores in this process's affinity mask."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_num_threads() -> int:
    """Library default thread count: cores in this process's affinity mask minus one, at least one.

    Deliberately not ``OMP_NUM_THREADS``: ``accelerate launch`` sets it to 1 for every worker.
    """
    return max(1, affinity_cores() - 1)


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return default_num_threads()
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1 or None (library default), got {num_threads}")
    return int(num_threads)


def backend() -> str:
    """Name of the implementation the ops dispatch to.

    One of ``avx512_bf16``, ``avx512``, ``avx2``, ``neon``, ``sve``, ``scalar`` (compiled library; honours
    ``HF_SUPEROFFLOAD_CPU_ADAM_ISA``) or ``torch-fallback``.
    """
    if not load_library():
        return "torch-fallback"
    return str(torch.ops.hf_superoffload.cpu_adam_isa())


def cpu_adamw_step_(
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
    num_threads: int | None = None,
    store_moments: bool = True,
    store_master: bool = True,
) -> None:
    """One ``torch.optim.AdamW`` step on contiguous fp32 ``param``/``exp_avg``/``exp_avg_sq``.

    One fused pass: reads the gradient (bf16 upcast in registers), updates p/m/v, and writes the optional
    outputs. Equal to ``torch.optim.AdamW`` up to fp32 rounding.

    In place by default. With ``source`` the step is out of place (double-buffered state): the pre-step
    state is read from ``source`` and the new state written to ``param``/``exp_avg``/``exp_avg_sq``, which
    are then pure outputs; ``source`` is left unchanged. The result is bit for bit that of the in-place step
    on the same values, and large calls stream the destination (non-temporal stores), so the pass moves the
    same bytes as in place.

    Args:
        grad: fp32 or bf16 gradient, multiplied by ``grad_scale`` inside the pass (the clip coefficient).
        step: the step count *after* this update (1 on the first step).
        hyper: lr, betas, eps and weight_decay of this parameter's group.
        param_bf16_out: receives the bf16 copy (round to nearest even) of the updated parameter.
        source: pre-step (param, exp_avg, exp_avg_sq): fp32, contiguous, same numel, disjoint from every
            destination, from ``grad`` and from ``param_bf16_out`` (``ValueError`` on a partial overlap). A
            source tensor with its destination's data pointer is read in place.
        num_threads: threads for this call; ``None`` uses :func:`default_num_threads`.
        store_moments: ``False``: the new ``exp_avg``/``exp_avg_sq`` update ``param`` (and its bf16 copy) but are
            not stored: in place they keep the pre-step moments, out of place the destination moments are not
            written at all. :func:`cpu_adamw_moments_` stores them later, bit for bit as this step would have
            (20 instead of 28 B/param in this pass; [Note: deferred moments] in docs/design.md).
        store_master: ``False`` (only with ``store_moments=False`` and ``param_bf16_out``, else ``ValueError``):
            ``param`` is not stored either, so the pass writes only the bf16 copy of the updated parameter (16
            B/param: reads p, m, v and the bf16 grad, writes the bf16 copy). In place ``param``/``exp_avg``/
            ``exp_avg_sq`` keep the pre-step state; out of place the destinations are not written at all. A later
            full step (``store_moments=True``, ``store_master=True``) on the same pre-step state, ``grad`` and
            hyper-parameters commits p_t, m_t, v_t, bit for bit those of a single full step; the bf16 copy written
            here is bit for bit that full step's copy ([Note: deferred moment stores] in cpu_ext/csrc/kernels_common.h).
    """
    if source is not None and len(source) != 3:
        raise ValueError(f"source must be three tensors (param, exp_avg, exp_avg_sq), got {len(source)}")
    require_hyper(hyper)
    threads = _threads(num_threads)
    if load_library():
        src_p, src_m, src_v = source if source is not None else (None, None, None)
        torch.ops.hf_superoffload.cpu_adamw_step(
            param, grad, exp_avg, exp_avg_sq, int(step), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
            hyper.weight_decay, float(grad_scale), param_bf16_out, src_p, src_m, src_v, threads, bool(store_moments),
            bool(store_master),
        )
        return
    _fallback.adamw_step_(
        param, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale,
        param_bf16_out=param_bf16_out, source=source, store_moments=store_moments, store_master=store_master,
    )


def cpu_adamw_moments_(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    hyper: AdamWHyper,
    grad_scale: float = 1.0,
    source: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_threads: int | None = None,
) -> None:
    """Store the moments of a :func:`cpu_adamw_step_` taken with ``store_moments=False``.

    ``exp_avg``/``exp_avg_sq`` := m_t, v_t computed from the pre-step moments (in place, or read from ``source`` =
    (exp_avg, exp_avg_sq) when the step was out of place) and the same ``grad``, ``grad_scale`` and ``hyper`` (only
    its betas are read): bit for bit what the step with ``store_moments=True`` stores, on every path (reads 10,
    writes 8 B/param with a bf16 gradient).
    """
    if source is not None and len(source) != 2:
        raise ValueError(f"source must be two tensors (exp_avg, exp_avg_sq), got {len(source)}")
    require_hyper(hyper)
    threads = _threads(num_threads)
    if load_library():
        src_m, src_v = source if source is not None else (None, None)
        torch.ops.hf_superoffload.cpu_adamw_moments(
            grad, exp_avg, exp_avg_sq, hyper.beta1, hyper.beta2, float(grad_scale), src_m, src_v, threads,
        )
        return
    _fallback.adamw_moments_(grad, exp_avg, exp_avg_sq, hyper=hyper, grad_scale=grad_scale, source=source)


def cpu_adamw_undo_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float = 1.0,
    param_bf16_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Algebraic inverse of :func:`cpu_adamw_step_` with the same arguments (fp32-rounding exact).

    ``param_bf16_out``, when given, receives the bf16 copy of the restored parameter. In place only: after an
    out-of-place step the source still holds the pre-step state, so there is nothing to undo.
    """
    require_hyper(hyper)
    threads = _threads(num_threads)
    if load_library():
        torch.ops.hf_superoffload.cpu_adamw_undo(
            param, grad, exp_avg, exp_avg_sq, int(step), hyper.lr, hyper.beta1, hyper.beta2, hyper.eps,
            hyper.weight_decay, float(grad_scale), param_bf16_out, threads,
        )
        return
    _fallback.reference.adamw_undo_(  # rare (rollback only): the eager twin is the fallback
        param, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale,
        param_bf16_out=param_bf16_out,
    )


def grad_sumsq_nonfinite(grad: torch.Tensor, *, num_threads: int | None = None) -> tuple[float, int]:
    """Sum of squares (fp64 accumulation) and number of inf/NaN elements of a bf16/fp32 host tensor.

    One pass over ``grad``. With non-finite elements the sum is inf or NaN, as in torch.
    """
    threads = _threads(num_threads)
    if load_library():
        sumsq, nonfinite = torch.ops.hf_superoffload.grad_sumsq_nonfinite(grad, threads)
        return float(sumsq), int(nonfinite)
    return _fallback.grad_sumsq_nonfinite(grad)
