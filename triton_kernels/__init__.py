"""GPU-side kernels (installed as ``hf_superoffload.triton_kernels``).

Each kernel has an eager twin in :mod:`.reference` (the test oracle and the fallback). Every public
function here validates its arguments, then dispatches:

* CUDA tensors -> the Triton kernel, when Triton imports, compiles natively in this process and passed a
  one-time smoke test on that device;
* CPU tensors -> the Triton kernel run by Triton's interpreter, when ``TRITON_INTERPRET=1`` is set (it must
  be set *before* ``triton`` is first imported: Triton fixes the interpreter per process) -- this is how CI
  exercises the kernels on a machine without a GPU;
* anything else, an unsupported dtype or layout, or ``HF_SUPEROFFLOAD_DISABLE_TRITON=1`` -> the twin.

Triton is imported lazily, on the first call that could use it, never at package import.
:func:`backend_for`, :func:`last_backend` and :func:`triton_status` say which path runs and why.

Layering per op: private ``@triton.jit`` kernel and its launcher (block sizes, work tables) in
:mod:`._kernels` -> the public function here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Literal

import torch

# The banned-api rule resolves `.` to the bare folder name; relative is what the ban asks for
from ..cpu_ext._hyper import AdamWHyper, require_hyper
from . import reference as _ref
from .reference import sumsq_nonfinite  # eager on every device: no kernel of its own

__all__ = [
    "adamw_flat_",
    "backend_for",
    "flatten_grads_with_stats_",
    "last_backend",
    "scatter_flat_",
    "spread_stats_rows",
    "sumsq_nonfinite",
    "triton_status",
    "upcast_",
]

Backend = Literal["triton", "reference"]

_DISABLE_ENV = "HF_SUPEROFFLOAD_DISABLE_TRITON"
_TRUE = {"1", "true", "yes", "on"}

_lock = threading.Lock()
_kmod: ModuleType | None = None  # the lazily imported ._kernels module
_import_error: str | None = None
_import_tried = False
_smoke: dict[str, str | None] = {}  # device string -> None (passed) or the error text
_last: dict[str, Backend] = {}


def _load_kernels() -> ModuleType | None:
    """Import :mod:`._kernels` (and so ``triton``) once; ``None`` when that fails."""
    global _kmod, _import_error, _import_tried
    if _import_tried:
        return _kmod
    with _lock:
        if not _import_tried:
            try:
                _kmod = importlib.import_module("._kernels", __name__)
            except Exception as e:  # ImportError, or a broken triton install
                _import_error = f"{type(e).__name__}: {e}"
            _import_tried = True
    return _kmod


def triton_status() -> dict[str, Any]:
    """Where Triton stands in this process (imports it if not yet done).

    Returns:
        ``{"importable": bool, "mode": "native" | "interpreter" | "inconsistent" | None,
        "error": str | None, "disabled": bool, "smoke": {device: None or error}}``. ``"inconsistent"``
        means ``TRITON_INTERPRET`` was set after ``triton`` was imported: the kernels are then never used.
    """
    k = _load_kernels()
    return {
        "importable": k is not None,
        "mode": k.mode() if k is not None else None,
        "error": _import_error,
        "disabled": os.environ.get(_DISABLE_ENV, "").strip().lower() in _TRUE,
        "smoke": dict(_smoke),
    }


_INTERPRETER_LOCK = threading.RLock()
"""Triton's interpreter is not thread-safe (the engine's CPU worker and the training thread both launch): one
interpreted launch at a time. Compiled launches need no lock."""


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for a launch (Triton launches on the current CUDA device); on CPU (the
    interpreter) hold the interpreter lock."""
    return torch.cuda.device(device) if device.type == "cuda" else _INTERPRETER_LOCK


def _smoke_ok(k: ModuleType, device: torch.device) -> bool:
    """Run the kernels' self-test once per device (it synchronises once); ``True`` when it passed."""
    key = str(device)
    if key in _smoke:
        return _smoke[key] is None
    with _lock:
        if key not in _smoke:
            try:
                with _on(device):
                    k.smoke_test(device)
                _smoke[key] = None
            except Exception as e:
                _smoke[key] = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"hf_superoffload: Triton kernels failed their self-test on {key} ({_smoke[key]}); "
                    "using the eager twins",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _smoke[key] is None


def backend_for(*tensors: torch.Tensor | None) -> Backend:
    """Which path a call on these tensors takes: ``"triton"`` or ``"reference"``.

    Looks only at devices and the environment (dtype/layout support is checked per op). All non-``None``
    tensors must share one device for the Triton path.
    """
    if os.environ.get(_DISABLE_ENV, "").strip().lower() in _TRUE:
        return "reference"
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        return "reference"
    (device,) = devices
    if device.type == "cuda":
        want = "native"
    elif device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "").strip() == "1":
        want = "interpreter"
    else:
        return "reference"
    k = _load_kernels()
    if k is None or k.mode() != want:
        if want == "native":
            _warn_no_native(k)
        return "reference"
    return "triton" if _smoke_ok(k, device) else "reference"


_warned_no_native = False


def _warn_no_native(k: ModuleType | None) -> None:
    """Once, loudly: on a GPU the eager twins are several times slower than the kernels (docs/benchmarks.md), so a
    broken Triton install must not pass unnoticed."""
    global _warned_no_native
    if _warned_no_native:
        return
    _warned_no_native = True
    why = (f"Triton cannot be imported ({_import_error})" if k is None
           else "TRITON_INTERPRET was set after triton was imported")
    warnings.warn(f"hf_superoffload: {why}; the GPU-side casts and gradient statistics run on their eager torch "
                  f"twins (slower). Install triton>=3.6 (pip install 'triton>=3.6'), or set {_DISABLE_ENV}=1 to "
                  "choose the eager path and silence this", RuntimeWarning, stacklevel=3)


def last_backend(op: str) -> Backend | None:
    """The path the most recent call of public function ``op`` (e.g. ``"scatter_flat_"``) took."""
    return _last.get(op)


def _record(op: str, backend: Backend) -> Backend:
    _last[op] = backend
    return backend


def _supported(*tensors: torch.Tensor | None) -> bool:
    """Dtypes the kernels handle, at addresses that are whole elements (the work tables use offsets)."""
    k = _kmod
    return k is not None and all(
        t is None or (t.dtype in k.SUPPORTED_DTYPES and t.data_ptr() % t.element_size() == 0) for t in tensors
    )


# ----------------------------------------------------------------------------------------- public ops


def flatten_grads_with_stats_(
    grads: Sequence[torch.Tensor | None],
    sizes: Sequence[int],
    out: torch.Tensor,
    stats: torch.Tensor | None = None,
) -> None:
    """Copy ``grads`` back to back into ``out`` (``None`` writes zeros) and add their statistics to ``stats``.

    Semantics are those of :func:`.reference.flatten_grads_with_stats_`: the column sums of ``stats``
    (float32 ``[2]`` or ``[rows, 2]`` on ``out``'s device) grow by ``[sum of squares, non-finite count]`` of
    the values *as stored in* ``out`` (so after rounding to ``out``'s dtype), with no host synchronisation.
    The Triton path does it in one launch per distinct gradient dtype over a cached device-side work table
    of (source offset, bucket offset, flags, count) rows; a launch of at most ``ENTRY_SLOTS`` (8) rows,
    all 16-byte aligned, may pass its rows as kernel arguments instead (kernel 3, where the size table
    says so: no table lookup before the first tile). With ``[2]`` (or too few rows) the statistics are
    reduced deterministically in the launch, by its last program or a tiny second launch (see
    :mod:`._configs`); with ``[rows, 2]``, ``rows >= spread_stats_rows(device, sizes)``, each program adds its
    partial to its own row and the reader sums the rows (``stats.sum(0)``, deterministic too): no serial
    reduction at the end of the launch ([Note: spread statistics] in docs/design.md). The eager twin (CPU
    tensors without the interpreter, or no Triton) sums in fixed blocks of its own, the same bits whatever
    torch's thread count ([Note: determinism]). Non-contiguous
    gradients are first made contiguous (a temporary copy); a call mixing devices goes to the twin.

    Args:
        grads: per-parameter gradients of any shape, ``grads[i].numel() == sizes[i]``.
        sizes: element count of each entry.
        out: flat destination of ``sum(sizes)`` elements, usually bf16 (fp32 and fp16 work too).
        stats: float32 ``[2]`` or ``[rows, 2]``, contiguous, on ``out``'s device, accumulated in place;
            ``None`` skips the statistics.

    Raises:
        ValueError: sizes that do not match, or ``stats`` of another shape or dtype.
    """
    grads = list(grads)
    sizes = [int(n) for n in sizes]
    if len(grads) != len(sizes):
        raise ValueError(f"{len(grads)} gradients but {len(sizes)} sizes")
    if sum(sizes) != out.numel():
        raise ValueError(f"entries hold {sum(sizes)} elements but the bucket has {out.numel()}")
    for g, n in zip(grads, sizes):
        if g is not None and g.numel() != n:
            raise ValueError(f"gradient has {g.numel()} elements, expected {n}")
    if stats is not None and not (
        stats.dtype == torch.float32
        and (tuple(stats.shape) == (2,) or (stats.dim() == 2 and stats.shape[1] == 2))
    ):
        raise ValueError(
            f"stats must be float32 of shape [2] or [rows, 2], got {stats.dtype} {tuple(stats.shape)}: allocate "
            "torch.zeros(2) or torch.zeros(spread_stats_rows(device, sizes), 2) on the bucket's device"
        )
    backend = backend_for(out, stats, *grads)
    if backend == "triton" and not (
        _supported(out, *grads) and out.is_contiguous() and (stats is None or stats.is_contiguous())
    ):
        backend = "reference"
    if _record("flatten_grads_with_stats_", backend) == "reference":
        _ref.flatten_grads_with_stats_(grads, sizes, out, stats)
        return
    assert _kmod is not None
    prepared = [g if g is None or g.is_contiguous() else g.contiguous() for g in grads]
    with _on(out.device):
        _kmod.launch_flatten(prepared, sizes, out.view(-1), stats)


def spread_stats_rows(device: torch.device | str, sizes: Sequence[int] = ()) -> int:
    """Rows of a ``[rows, 2]`` statistics buffer with which :func:`flatten_grads_with_stats_` spreads the
    statistics of a bucket of entries of ``sizes`` elements, one row per program, instead of reducing them at
    the end of its launch (more rows work too; fewer make it reduce). Does not import Triton."""
    from ._configs import INTERP_SMS, SPREAD_MIN_CHUNK, SPREAD_ROWS_PER_SM

    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERP_SMS
    chunks = sum(-(-int(n) // SPREAD_MIN_CHUNK) for n in sizes)
    return max(sms * SPREAD_ROWS_PER_SM, chunks)


def scatter_flat_(
    flat: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """Copy consecutive slices of ``flat`` into ``params``, casting to each one's dtype.

    fp32 -> bf16 rounds to nearest even, bit-identical to ``torch.Tensor.to(torch.bfloat16)`` for every
    non-NaN value (NaN stays a quiet NaN of the same sign). With ``stochastic_rounding=True`` fp32 -> bf16
    rounds stochastically instead: unbiased, always one of the two bf16 neighbours; the random bits are a
    counter-based hash of ``offset + flat index`` keyed by ``seed`` (vary ``seed`` or ``offset`` per step),
    the same on the Triton path and the twin (:func:`.reference.noise16`). Same-dtype
    slices are plain bit copies. The Triton path is one launch per distinct parameter dtype; non-contiguous
    parameters go through a contiguous temporary and a ``copy_``.
    """
    params = list(params)
    total = sum(p.numel() for p in params)
    if total != flat.numel():
        raise ValueError(f"parameters hold {total} elements but the flat buffer has {flat.numel()}")
    backend = backend_for(flat, *params)
    if backend == "triton" and not (_supported(flat, *params) and flat.is_contiguous()):
        backend = "reference"
    if _record("scatter_flat_", backend) == "reference":
        _ref.scatter_flat_(flat, params, stochastic_rounding=stochastic_rounding, seed=seed, offset=offset)
        return
    assert _kmod is not None
    targets = [
        p if p.is_contiguous() else torch.empty_like(p, memory_format=torch.contiguous_format) for p in params
    ]
    with _on(flat.device):
        _kmod.launch_scatter(
            flat.view(-1), targets, stochastic_rounding=stochastic_rounding, seed=seed, offset=offset
        )
    for p, t in zip(params, targets):
        if t is not p:
            p.copy_(t)


def upcast_(src: torch.Tensor, dst: torch.Tensor, scale: float | torch.Tensor = 1.0) -> None:
    """``dst[:] = float32(src) * scale`` on flat buffers (src bf16, fp16 or fp32; dst fp32).

    ``scale`` is a Python float or a 0-dim tensor on the device (read by the kernel: no host sync).
    Bit-identical to ``dst.copy_(src); dst.mul_(scale)``.
    """
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements but dst has {dst.numel()}")
    scale_t = scale if isinstance(scale, torch.Tensor) else None
    if scale_t is not None and scale_t.numel() != 1:
        raise ValueError(f"scale must be a float or a one-element tensor, got shape {tuple(scale_t.shape)}")
    backend = backend_for(src, dst, scale_t)
    if backend == "triton" and not (
        _supported(src) and dst.dtype == torch.float32 and src.is_contiguous() and dst.is_contiguous()
    ):
        backend = "reference"
    if _record("upcast_", backend) == "reference":
        _ref.upcast_(src, dst, scale)
        return
    assert _kmod is not None
    if scale_t is not None and scale_t.dtype != torch.float32:
        scale_t = scale_t.to(torch.float32)  # device-side cast, no sync
    with _on(src.device):
        _kmod.launch_upcast(src.view(-1), dst.view(-1), scale_t if scale_t is not None else float(scale))


def adamw_flat_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float | torch.Tensor = 1.0,
    param_bf16_out: torch.Tensor | None = None,
) -> None:
    """Fused ``torch.optim.AdamW`` step on flat fp32 device buffers, in one pass (the GPU-resident tail).

    Math and operation order are those of :func:`.reference.adamw_flat_` / ``torch.optim.AdamW``
    (decoupled weight decay, bias correction, ``step`` = the 1-based count after this update, ``hyper`` the
    group's lr, betas, eps and weight_decay); results agree to fp32 rounding. ``param`` is the fp32 master;
    ``grad`` is bf16 or fp32; ``g = grad * grad_scale`` where ``grad_scale`` is a float or a 0-dim fp32 device
    tensor (e.g. a clip coefficient computed on the GPU: no host sync). ``param_bf16_out`` (optional) receives
    the updated parameters rounded to nearest-even bf16 in the same pass.
    """
    require_hyper(hyper)
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor, got {t.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad must be float32 or bfloat16, got {grad.dtype}")
    n = param.numel()
    if not (grad.numel() == exp_avg.numel() == exp_avg_sq.numel() == n):
        raise ValueError("param, grad, exp_avg and exp_avg_sq must have the same number of elements")
    if param_bf16_out is not None and (param_bf16_out.dtype != torch.bfloat16 or param_bf16_out.numel() != n):
        raise ValueError("param_bf16_out must be a bfloat16 tensor with as many elements as param")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this update), got {step}")
    gs_t = grad_scale if isinstance(grad_scale, torch.Tensor) else None
    if gs_t is not None and gs_t.numel() != 1:
        raise ValueError(f"grad_scale must be a float or a one-element tensor, got shape {tuple(gs_t.shape)}")
    backend = backend_for(param, grad, exp_avg, exp_avg_sq, param_bf16_out, gs_t)
    if backend == "triton" and not (
        grad.is_contiguous() and (param_bf16_out is None or param_bf16_out.is_contiguous())
    ):
        backend = "reference"
    if _record("adamw_flat_", backend) == "reference":
        _ref.adamw_flat_(param, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale,
                         param_bf16_out=param_bf16_out)  # fmt: skip
        return
    assert _kmod is not None
    if gs_t is not None and gs_t.dtype != torch.float32:
        gs_t = gs_t.to(torch.float32)
    with _on(param.device):
        _kmod.launch_adamw(
            param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1), step=step, hyper=hyper,
            grad_scale=gs_t if gs_t is not None else float(grad_scale),
            param_bf16_out=param_bf16_out.view(-1) if param_bf16_out is not None else None,
        )  # fmt: skip
