"""Deferred moment stores ([Note: deferred moments] in docs/design.md): a step with ``store_moments=False``
followed by ``cpu_adamw_moments_`` stores exactly what one step with ``store_moments=True`` stores, bit for bit,
on every SIMD path, the torch fallback and the reference twin; in place and out of place.

Deferred master stores ([Note: deferred moment stores] in cpu_ext/csrc/kernels_common.h): a step with
``store_moments=False, store_master=False`` writes only the bf16 copy, bit for bit the full step's; the later
commit (an ordinary full step on the same pre-step state) stores the full step's p, m, v bit for bit."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from hf_superoffload import cpu_ext, ops
from hf_superoffload.ops import AdamWHyper

_fallback = importlib.import_module("hf_superoffload.cpu_ext._fallback")

SIZES = (1, 7, 15, 16, 17, 127, 1000003, 2**20 + 3)  # the last one streams its stores (>= 2**20 elements)
HYPER = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
BETAS_ONLY = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)  # the moment ops read only betas


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
    kwargs = {"step": 4, "grad_scale": grad_scale, "hyper": HYPER, **extra}
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

    moments_(g, lazy[1], lazy[2], hyper=HYPER, grad_scale=grad_scale,
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


_SENTINEL = 0x7FC0DEAD  # a NaN bit pattern no step computes (the kernels write 0xFFFF/0x7FC00000-style NaNs)


def _sentinel(n: int, offset: int = 0) -> torch.Tensor:
    return torch.full((n + offset,), _SENTINEL, dtype=torch.int32).view(torch.float32)[offset:]


def _bf16_sentinel(n: int) -> torch.Tensor:
    return torch.full((n,), 0x7FAB, dtype=torch.int16).view(torch.bfloat16)


def _check_late_master(step_: Step, n: int, grad_dtype: torch.dtype, out_of_place: bool, grad_scale: float,
                       **extra: object) -> None:
    """(a) the bf16-only pass writes the full step's bf16 copy; (b) it writes nothing else; (c) the commit (a full
    step without bf16 copy on the same pre-step state) stores the full step's p, m, v; all bitwise."""
    src = _state(n, seed=n + 11)
    g = (3 * torch.randn(n, generator=torch.Generator().manual_seed(n + 12))).to(grad_dtype)
    kwargs = {"step": 6, "grad_scale": grad_scale, "hyper": HYPER, **extra}
    source: tuple[torch.Tensor, ...] | None
    if out_of_place:  # destinations hold a sentinel, 3 elements off the source's alignment
        full, late = tuple(_sentinel(n) for _ in range(3)), tuple(_sentinel(n, 3) for _ in range(3))
        source = tuple(t.clone() for t in src)
    else:
        full, late = tuple(t.clone() for t in src), tuple(t.clone() for t in src)
        source = None
    out_full, out_late = _bf16_sentinel(n), _bf16_sentinel(n)
    late_before = [t.clone() for t in late]

    step_(full[0], g, full[1], full[2], param_bf16_out=out_full, source=source, **kwargs)
    step_(late[0], g, late[1], late[2], param_bf16_out=out_late, source=source, store_moments=False,
          store_master=False, **kwargs)

    assert _equal_bits(out_late, out_full), "(a) the bf16 copy differs from the full step's"
    assert not torch.equal(_bits(out_late), _bits(_bf16_sentinel(n))), "the bf16 copy was not written"
    for name, got, before in zip(("param", "exp_avg", "exp_avg_sq"), late, late_before):
        assert _equal_bits(got, before), f"(b) store_master=False wrote {name}"
    if source is not None:
        assert all(_equal_bits(a, b) for a, b in zip(source, src))  # the source is read only

    # (c) the commit: the ordinary full step, same pre-step state, gradient and hyper-parameters, no bf16 copy
    step_(late[0], g, late[1], late[2], source=source, **kwargs)
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), late, full):
        assert _equal_bits(got, want), f"(c) the commit's {name} differs from the single full step's"
    assert _equal_bits(out_late, out_full)  # the commit does not touch the early bf16 copy
    if source is not None:
        assert all(_equal_bits(a, b) for a, b in zip(source, src))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_late_master_bf16_only_then_commit_bitwise(isa: str, n: int, grad_dtype: torch.dtype, out_of_place: bool,
                                                   num_threads: int) -> None:
    _check_late_master(ops.cpu_adamw_step_, n, grad_dtype, out_of_place, 0.37, num_threads=num_threads)


@pytest.mark.parametrize("impl", ["fallback", "reference"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_fallback_and_reference_late_master_bitwise(impl: str, grad_dtype: torch.dtype, out_of_place: bool,
                                                    grad_scale: float) -> None:
    mod = _fallback if impl == "fallback" else cpu_ext.reference
    _check_late_master(mod.adamw_step_, 1029, grad_dtype, out_of_place, grad_scale)


def _compiled_step(*args: object, **kwargs: object) -> None:
    ops.cpu_adamw_step_(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", ["compiled", "fallback", "reference"])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_late_master_invalid_combinations_raise_before_writing(impl: str, out_of_place: bool,
                                                               request: pytest.FixtureRequest) -> None:
    if impl == "compiled":
        request.getfixturevalue("compiled")
        step_: Step = _compiled_step
    else:
        step_ = _fallback.adamw_step_ if impl == "fallback" else cpu_ext.reference.adamw_step_
    n = 33
    src = _state(n, seed=5)
    g = torch.randn(n).bfloat16()
    dst = tuple(_sentinel(n) for _ in range(3)) if out_of_place else tuple(t.clone() for t in src)
    source = tuple(t.clone() for t in src) if out_of_place else None
    out = _bf16_sentinel(n)
    before = [t.clone() for t in (*dst, out)]
    kwargs = {"step": 2, "hyper": HYPER}
    with pytest.raises(ValueError, match=r"store_master=False requires store_moments=False.*pass store_moments=False"):
        step_(dst[0], g, dst[1], dst[2], param_bf16_out=out, source=source, store_master=False, **kwargs)
    with pytest.raises(ValueError, match=r"store_master=False requires param_bf16_out.*pass param_bf16_out"):
        step_(dst[0], g, dst[1], dst[2], source=source, store_moments=False, store_master=False, **kwargs)
    with pytest.raises(ValueError, match=r"store_master=False requires store_moments=False"):
        step_(dst[0], g, dst[1], dst[2], source=source, store_master=False, **kwargs)
    for got, want in zip((*dst, out), before):
        assert _equal_bits(got, want), "an invalid call touched memory"
    if source is not None:
        assert all(_equal_bits(a, b) for a, b in zip(source, src))


def test_late_master_invalid_combinations_raw_op(compiled: None) -> None:
    n = 16
    p, g, m, v = torch.randn(n), torch.randn(n).bfloat16(), torch.randn(n), torch.rand(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    args = (2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0)
    with pytest.raises(ValueError, match="requires store_moments=False"):
        torch.ops.hf_superoffload.cpu_adamw_step(p, g, m, v, *args, out, None, None, None, 1, True, False)
    with pytest.raises(ValueError, match="requires param_bf16_out"):
        torch.ops.hf_superoffload.cpu_adamw_step(p, g, m, v, *args, None, None, None, None, 1, False, False)
    # the fake kernel agrees (FakeTensor tracing)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fp, fg, fm, fv, fo = (mode.from_tensor(t) for t in (p, g, m, v, out))
        with pytest.raises(ValueError, match="requires store_moments=False"):
            torch.ops.hf_superoffload.cpu_adamw_step(fp, fg, fm, fv, *args, fo, None, None, None, 1, True, False)
        with pytest.raises(ValueError, match="requires param_bf16_out"):
            torch.ops.hf_superoffload.cpu_adamw_step(fp, fg, fm, fv, *args, None, None, None, None, 1, False, False)


@pytest.mark.parametrize("n", (7, 127, 1000003))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_moments_op_matches_reference(isa: str, n: int, grad_dtype: torch.dtype) -> None:
    """The compiled moment op against the eager twin, within fp32 rounding (the twin uses lerp, no fma)."""
    _, m, v = _state(n, seed=3)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(grad_dtype)
    dst_m, dst_v = _nan(n), _nan(n)
    ops.cpu_adamw_moments_(g, dst_m, dst_v, hyper=BETAS_ONLY, grad_scale=0.37, source=(m, v))
    ref_m, ref_v = m.clone(), v.clone()
    cpu_ext.reference.adamw_moments_(g, ref_m, ref_v, hyper=BETAS_ONLY, grad_scale=0.37)
    torch.testing.assert_close(dst_m, ref_m, rtol=2e-6, atol=1e-8)
    torch.testing.assert_close(dst_v, ref_v, rtol=2e-6, atol=1e-10)
    # in place gives the same bits as out of place
    ops.cpu_adamw_moments_(g, m, v, hyper=BETAS_ONLY, grad_scale=0.37)
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
    torch.library.opcheck(torch.ops.hf_superoffload.cpu_adamw_step.default,
                          (p, g, m, v, 2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, out, None, None, None, 1, False, False))
    torch.library.opcheck(torch.ops.hf_superoffload.cpu_adamw_step.default,
                          (torch.zeros(n), g, torch.zeros(n), torch.zeros(n), 2, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, out,
                           torch.randn(n), torch.randn(n), torch.rand(n), 1, False, False))


def test_moments_contract_violations(compiled: None) -> None:
    g, m, v = torch.randn(16).bfloat16(), torch.randn(16), torch.rand(16)
    with pytest.raises(ValueError, match="two tensors"):
        ops.cpu_adamw_moments_(g, m, v, hyper=BETAS_ONLY, source=(m,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both source tensors or none"):
        torch.ops.hf_superoffload.cpu_adamw_moments(g, m, v, 0.9, 0.999, 1.0, torch.randn(16), None, 1)
    with pytest.raises(RuntimeError, match="share memory"):
        ops.cpu_adamw_moments_(g, m, m, hyper=BETAS_ONLY)
    with pytest.raises(RuntimeError, match="elements"):
        ops.cpu_adamw_moments_(g, m, torch.rand(17), hyper=BETAS_ONLY)
    with pytest.raises(RuntimeError, match="betas"):  # the op's own range, (0, 1): the undo divides by beta
        ops.cpu_adamw_moments_(g, m, v, hyper=AdamWHyper(lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0))
    with pytest.raises(ValueError, match=r"betas=\(1.0, 0.999\) are invalid"):  # refused before the op
        ops.cpu_adamw_moments_(g, m, v, hyper=AdamWHyper(lr=1e-3, beta1=1.0, beta2=0.999, eps=1e-8, weight_decay=0.0))
