"""Parity of the compiled CPU AdamW with torch.optim.AdamW and with cpu_ext.reference, per SIMD path."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload import cpu_ext, ops
from hf_superoffload.ops import AdamWHyper

SIZES = (1, 7, 1023, 2**20 + 3)


def _hyper(weight_decay: float) -> AdamWHyper:
    return AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay)


def _state(n: int, seed: int, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p, m, v after a few steps' worth of history; ``offset`` makes them unaligned views of a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.empty(3, n + offset)
    p, m, v = (buf[i, offset:] for i in range(3))
    p.copy_(torch.randn(n, generator=gen))
    m.copy_(0.1 * torch.randn(n, generator=gen))
    v.copy_(0.01 * torch.rand(n, generator=gen))
    return p, m, v


def _grad(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 3).to(dtype)


def _torch_adamw(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g32: torch.Tensor, *, step: int, weight_decay: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    param = torch.nn.Parameter(p.clone())
    h = _hyper(weight_decay)
    opt = torch.optim.AdamW([param], lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay, foreach=False)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    param.grad = g32.clone()
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


def _assert_close(got: torch.Tensor, want: torch.Tensor, *, rtol: float, atol: float) -> None:
    """``torch.testing.assert_close`` semantics (NaN equal to NaN), several times faster on large tensors."""
    err = (got - want).abs()
    bad = ~((err <= atol + rtol * want.abs()) | (torch.isnan(got) & torch.isnan(want)))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} mismatches; first at {i}: {got[i].item()!r} vs {want[i].item()!r}")


def _assert_bf16_copy(out: torch.Tensor, p: torch.Tensor) -> None:
    """``out`` is exactly ``p.to(bfloat16)`` (bit for bit; NaN only as NaN)."""
    want = p.to(torch.bfloat16)
    nan = torch.isnan(p)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize(("weight_decay", "grad_scale"), [(0.0, 1.0), (0.1, 0.37)])
def test_step_matches_torch_adamw(
    isa: str, n: int, grad_dtype: torch.dtype, with_out: bool, weight_decay: float, grad_scale: float
) -> None:
    p, m, v = _state(n, seed=n, offset=n % 5)
    g = _grad(n, grad_dtype, seed=n + 1)
    want_p, want_m, want_v = _torch_adamw(p, m, v, g.float() * grad_scale, step=3, weight_decay=weight_decay)
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    cpu_ext.reference.adamw_step_(ref_p, g, ref_m, ref_v, step=3, hyper=_hyper(weight_decay), grad_scale=grad_scale)
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16) if with_out else None

    ops.cpu_adamw_step_(
        p, g, m, v, step=3, hyper=_hyper(weight_decay), grad_scale=grad_scale, param_bf16_out=out
    )

    for got, want, ref in ((p, want_p, ref_p), (m, want_m, ref_m), (v, want_v, ref_v)):
        _assert_close(got, want, rtol=2e-6, atol=1e-7)
        _assert_close(got, ref, rtol=2e-6, atol=1e-7)
    if out is not None:
        _assert_bf16_copy(out, p)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_twenty_steps_match_torch_adamw(isa: str, grad_dtype: torch.dtype) -> None:
    n = 4099
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.05, foreach=False)
    p, m, v = param.detach().clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 21):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        param.grad = g.float()
        opt.step()
        ops.cpu_adamw_step_(
            p, g, m, v, step=step, hyper=AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05),
            param_bf16_out=out,
        )
    _assert_close(p, param.detach(), rtol=1e-5, atol=1e-6)
    _assert_close(m, opt.state[param]["exp_avg"], rtol=1e-5, atol=1e-7)
    _assert_close(v, opt.state[param]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    _assert_bf16_copy(out, p)


def _separate(n: int, *, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three NaN-filled fp32 buffers, each ``offset`` elements past a fresh (64-byte aligned) allocation."""
    return tuple(torch.full((n + offset,), float("nan"))[offset:] for _ in range(3))  # type: ignore[return-value]


def _bits(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.int32) for t in ts])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("dst_layout", ["aligned", "offset", "rows"])
def test_out_of_place_equals_in_place_bitwise(
    isa: str, n: int, grad_dtype: torch.dtype, with_out: bool, dst_layout: str
) -> None:
    """Same arithmetic, other addresses: bit for bit the in-place result, and the source is left unchanged.

    At 2**20 + 3 elements the destination streams when p/m/v can all be line aligned by the head peel
    ("aligned"; "offset": 3 elements off, so with the bf16 copy the peel anchors on p instead), and keeps
    regular stores when they cannot ("rows": rows of one buffer, m and v off by 12 B per row).
    """
    src = _state(n, seed=n + 7, offset=n % 5)
    g = _grad(n, grad_dtype, seed=n + 8)
    snapshot = _bits(*src)
    if dst_layout == "rows":
        dst = _state(n, seed=99)
        for t in dst:
            t.fill_(float("nan"))
    else:
        dst = _separate(n, offset=3 if dst_layout == "offset" else 0)
    out_oop = torch.full((n,), 7.0, dtype=torch.bfloat16) if with_out else None
    kwargs = {"step": 4, "hyper": _hyper(0.1), "grad_scale": 0.37}

    ops.cpu_adamw_step_(dst[0], g, dst[1], dst[2], param_bf16_out=out_oop, source=src, **kwargs)

    assert torch.equal(_bits(*src), snapshot)
    p, m, v = (t.clone() for t in src)
    out_in = torch.full((n,), 7.0, dtype=torch.bfloat16) if with_out else None
    ops.cpu_adamw_step_(p, g, m, v, param_bf16_out=out_in, **kwargs)
    assert torch.equal(_bits(*dst), _bits(p, m, v))
    if out_oop is not None and out_in is not None:
        assert torch.equal(out_oop.view(torch.int16), out_in.view(torch.int16))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_double_buffered_steps_equal_in_place(isa: str, threads: int) -> None:
    """Ping-pong between two state buffers over several steps, one array (m) in place ("mixed") on the way."""
    n = 2**20 + 3
    a, b = _separate(n), _separate(n)  # aligned: every out-of-place step streams its stores
    for t, x in zip(a, _state(n, seed=11)):
        t.copy_(x)
    ref = tuple(t.clone() for t in a)
    out, out_ref = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    src, dst = a, b
    for step in range(1, 5):
        g = _grad(n, torch.bfloat16, seed=step)
        kwargs = {"step": step, "hyper": _hyper(0.01), "num_threads": threads}
        if step == 3:  # mixed: exp_avg in place, param and exp_avg_sq out of place
            dst = (dst[0], src[1], dst[2])
        ops.cpu_adamw_step_(dst[0], g, dst[1], dst[2], param_bf16_out=out, source=src, **kwargs)
        ops.cpu_adamw_step_(ref[0], g, ref[1], ref[2], param_bf16_out=out_ref, **kwargs)
        assert torch.equal(_bits(*dst), _bits(*ref)), f"step {step}"
        assert torch.equal(out.view(torch.int16), out_ref.view(torch.int16))
        src, dst = dst, src


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_undo_restores_the_pre_step_state(isa: str, n: int, grad_dtype: torch.dtype) -> None:
    p, m, v = _state(n, seed=5)
    g = _grad(n, grad_dtype, seed=6)
    before = (p.clone(), m.clone(), v.clone())
    kwargs = {"step": 4, "hyper": _hyper(0.1), "grad_scale": 0.5}
    ops.cpu_adamw_step_(p, g, m, v, **kwargs)
    after = (p.clone(), m.clone(), v.clone())
    out = torch.empty(n, dtype=torch.bfloat16)
    ops.cpu_adamw_undo_(p, g, m, v, param_bf16_out=out, **kwargs)
    for got, want, post in zip((p, m, v), before, after):
        # The inverse cancels terms of the post-step value, so the error scales with it (fp32 rounding).
        tol = 16 * torch.finfo(torch.float32).eps * (post.abs() + want.abs()) / 0.9
        assert bool(((got - want).abs() <= tol).all())
    _assert_bf16_copy(out, p)
    ref = tuple(t.clone() for t in after)
    cpu_ext.reference.adamw_undo_(*ref[:1], g, *ref[1:], **kwargs)
    _assert_close(p, ref[0], rtol=1e-6, atol=1e-7)


def test_bf16_copy_rounds_special_values_like_torch(isa: str) -> None:
    """lr = 0 with zero grad and moments leaves p unchanged, so the bf16 copy is the conversion of p."""
    specials = torch.tensor(
        [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x00000001,
         0x807FFFFF, 0x00018000, 0x00800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF,
         0xFF7FFFFF, 0x7F7F7FFF, 0x40490FDB],
        dtype=torch.int64,
    ).to(torch.int32)
    gen = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(-(2**31), 2**31 - 1, (5000,), generator=gen, dtype=torch.int32)
    p = torch.cat([specials, rand_bits]).view(torch.float32).clone()
    n = p.numel()
    m, v, g = torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    before = p.clone()
    ops.cpu_adamw_step_(p, g, m, v, step=1, hyper=AdamWHyper(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
                        param_bf16_out=out)
    assert torch.equal(torch.isnan(p), torch.isnan(before))
    finite_or_inf = ~torch.isnan(before)
    assert torch.equal(p.view(torch.int32)[finite_or_inf], before.view(torch.int32)[finite_or_inf])
    _assert_bf16_copy(out, before)
