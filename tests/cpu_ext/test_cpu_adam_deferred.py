"""Deferred moment stores ([Note: deferred moments] in docs/design.md): a step with ``store_moments=False``
followed by ``cpu_adamw_moments_`` stores exactly what one step with ``store_moments=True`` stores, bit for bit,
on every SIMD path, the torch fallback and the reference twin; in place and out of place."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from hf_superoffload import cpu_ext, ops

_fallback = importlib.import_module("hf_superoffload.cpu_ext._fallback")

SIZES = (1, 7, 15, 16, 17, 127, 1000003, 2**20 + 3)  # the last one streams its stores (>= 2**20 elements)
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


def _state(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _nan(n: int, offset: int = 0) -> torch.Tensor:
    return torch.full((n + offset,), float("nan"))[offset:]


Step = Callable[..., None]
Moments = Callable[..., None]


def _check_deferred_equals_full(step_: Step, moments_: Moments, n: int, grad_dtype: torch.dtype,
                                out_of_place: bool, grad_scale: float, **extra: object) -> None:
    src = _state(n, seed=n)
    g = (3 * torch.randn(n, generator=torch.Generator().manual_seed(n + 1))).to(grad_dtype)
    kwargs = {"step": 4, "grad_scale": grad_scale, **HYPER, **extra}
    if out_of_place:  # destinations NaN-filled and 3 elements off the source's alignment
        full, lazy = tuple(_nan(n) for _ in range(3)), tuple(_nan(n, 3) for _ in range(3))
        source: tuple[torch.Tensor, ...] | None = tuple(t.clone() for t in src)
    else:
        full, lazy = tuple(t.clone() for t in src), tuple(t.clone() for t in src)
        source = None
    out_full, out_lazy = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    moments_before = [lazy[1].clone(), lazy[2].clone()]

    step_(full[0], g, full[1], full[2], param_bf16_out=out_full, source=source, **kwargs)
    step_(lazy[0], g, lazy[1], lazy[2], param_bf16_out=out_lazy, source=source, store_moments=False, **kwargs)

    # p and the bf16 copy are final; the moments are untouched (out of place: still the NaN fill)
    assert _equal_bits(lazy[0], full[0])
    assert _equal_bits(out_lazy, out_full)
    assert _equal_bits(lazy[1], moments_before[0]) and _equal_bits(lazy[2], moments_before[1])
    if source is not None:
        assert all(_equal_bits(a, b) for a, b in zip(source, src))  # the source is read only

    moments_(g, lazy[1], lazy[2], beta1=HYPER["beta1"], beta2=HYPER["beta2"], grad_scale=grad_scale,
             source=(source[1], source[2]) if source is not None else None,
             **({"num_threads": extra["num_threads"]} if "num_threads" in extra else {}))

    for got, want in zip(lazy, full):
        assert _equal_bits(got, want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_deferred_moments_equal_the_full_step_bitwise(isa: str, n: int, grad_dtype: torch.dtype,
                                                      out_of_place: bool) -> None:
    _check_deferred_equals_full(ops.cpu_adamw_step_, ops.cpu_adamw_moments_, n, grad_dtype, out_of_place, 0.37,
                                num_threads=2)


@pytest.mark.parametrize("impl", ["fallback", "reference"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_fallback_and_reference_deferred_moments_bitwise(impl: str, grad_dtype: torch.dtype, out_of_place: bool,
                                                         grad_scale: float) -> None:
    mod = _fallback if impl == "fallback" else cpu_ext.reference
    _check_deferred_equals_full(mod.adamw_step_, mod.adamw_moments_, 1029, grad_dtype, out_of_place, grad_scale)


@pytest.mark.parametrize("n", (7, 127, 1000003))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_moments_op_matches_reference(isa: str, n: int, grad_dtype: torch.dtype) -> None:
    """The compiled moment op against the eager twin, within fp32 rounding (the twin uses lerp, no fma)."""
    _, m, v = _state(n, seed=3)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(grad_dtype)
    dst_m, dst_v = _nan(n), _nan(n)
    ops.cpu_adamw_moments_(g, dst_m, dst_v, beta1=0.9, beta2=0.999, grad_scale=0.37, source=(m, v))
    ref_m, ref_v = m.clone(), v.clone()
    cpu_ext.reference.adamw_moments_(g, ref_m, ref_v, beta1=0.9, beta2=0.999, grad_scale=0.37)
    torch.testing.assert_close(dst_m, ref_m, rtol=2e-6, atol=1e-8)
    torch.testing.assert_close(dst_v, ref_v, rtol=2e-6, atol=1e-10)
    # in place gives the same bits as out of place
    ops.cpu_adamw_moments_(g, m, v, beta1=0.9, beta2=0.999, grad_scale=0.37)
    assert _equal_bits(m, dst_m) and _equal_bits(v, dst_v)


def test_opcheck_moments_and_lazy_step(compiled: None) -> None:
    n = 37
    gen = torch.Generator().manual_seed(0)
    g, m, v = torch.randn(n, generator=gen).bfloat16(), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    torch.library.opcheck(torch.ops.hf_superoffload.cpu_adamw_moments.default,
                          (g, m, v, 0.9, 0.999, 0.5, None, None, 1))
    torch.library.opcheck(torch.ops.hf_superoffload.cpu_adamw_moments.default,
                          (g, m, v, 0.9, 0.999, 0.5, torch.randn(n), torch.rand(n), 1))
    p, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.hf_superoffload.cpu_adamw_step.default,
                          (p, g, m, v, 2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, out, None, None, None, 1, False))


def test_moments_contract_violations(compiled: None) -> None:
    g, m, v = torch.randn(16).bfloat16(), torch.randn(16), torch.rand(16)
    with pytest.raises(ValueError, match="two tensors"):
        ops.cpu_adamw_moments_(g, m, v, beta1=0.9, beta2=0.999, source=(m,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both source tensors or none"):
        torch.ops.hf_superoffload.cpu_adamw_moments(g, m, v, 0.9, 0.999, 1.0, torch.randn(16), None, 1)
    with pytest.raises(RuntimeError, match="share memory"):
        ops.cpu_adamw_moments_(g, m, m, beta1=0.9, beta2=0.999)
    with pytest.raises(RuntimeError, match="elements"):
        ops.cpu_adamw_moments_(g, m, torch.rand(17), beta1=0.9, beta2=0.999)
    with pytest.raises(RuntimeError, match="betas"):
        ops.cpu_adamw_moments_(g, m, v, beta1=1.0, beta2=0.999)
