"""The torch fallback used when the op library cannot be built: numerics and the one warning."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hf_superoffload.cpu_ext import AdamWHyper

from hf_superoffload import cpu_ext

_fallback = importlib.import_module("hf_superoffload.cpu_ext._fallback")


def _hyper(weight_decay: float) -> AdamWHyper:
    return AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_scale", [1.0, 0.25])
def test_fallback_step_matches_reference(grad_dtype: torch.dtype, grad_scale: float) -> None:
    n = 1023
    gen = torch.Generator().manual_seed(1)
    p, m, v = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    g_before = g.clone()
    ref = [p.clone(), m.clone(), v.clone()]
    cpu_ext.reference.adamw_step_(ref[0], g, ref[1], ref[2], step=3, hyper=_hyper(0.1), grad_scale=grad_scale)
    before = (p.clone(), m.clone(), v.clone())
    out = torch.empty(n, dtype=torch.bfloat16)
    _fallback.adamw_step_(p, g, m, v, step=3, hyper=_hyper(0.1), grad_scale=grad_scale, param_bf16_out=out)
    for got, want in zip((p, m, v), ref):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    assert torch.equal(out, p.to(torch.bfloat16))
    assert torch.equal(g, g_before)  # the caller's gradient is not scaled in place

    # without the op library, ops.cpu_adamw_undo_ runs the eager twin (rollback is rare)
    cpu_ext.reference.adamw_undo_(p, g, m, v, step=3, hyper=_hyper(0.1), grad_scale=grad_scale)
    torch.testing.assert_close(p, before[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["fallback", "reference"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_out_of_place_source(impl: str, grad_dtype: torch.dtype) -> None:
    """``source``: bit for bit the in-place step of the same implementation; the source is left unchanged."""
    step_ = _fallback.adamw_step_ if impl == "fallback" else cpu_ext.reference.adamw_step_
    n = 1023
    gen = torch.Generator().manual_seed(2)
    src = (torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen), torch.rand(n, generator=gen))
    g = torch.randn(n, generator=gen).to(grad_dtype)
    snapshot = [t.clone() for t in src]
    dst = tuple(torch.full((n,), float("nan")) for _ in range(3))
    out_oop, out_in = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    kwargs = {"step": 3, "hyper": _hyper(0.1), "grad_scale": 0.5}

    step_(dst[0], g, dst[1], dst[2], param_bf16_out=out_oop, source=src, **kwargs)

    assert all(torch.equal(a, b) for a, b in zip(src, snapshot))
    p, m, v = (t.clone() for t in src)
    step_(p, g, m, v, param_bf16_out=out_in, **kwargs)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(dst, (p, m, v)))
    assert torch.equal(out_oop, out_in)
    # Identical tensors mean in place.
    q, mm, vv = (t.clone() for t in snapshot)
    step_(q, g, mm, vv, source=(q, mm, vv), **kwargs)
    assert torch.equal(torch.cat([q, mm, vv]), torch.cat([p, m, v]))


@pytest.mark.parametrize("impl", ["fallback", "reference"])
def test_overlapping_source_raises(impl: str) -> None:
    step_ = _fallback.adamw_step_ if impl == "fallback" else cpu_ext.reference.adamw_step_
    kwargs = {"step": 1, "hyper": _hyper(0.0)}
    buf = torch.randn(40)
    m, v, g = torch.zeros(16), torch.zeros(16), torch.randn(16)
    with pytest.raises(ValueError, match="src_param partially overlaps param"):
        step_(buf[:16], g, m, v, source=(buf[4:20], torch.zeros(16), torch.zeros(16)), **kwargs)
    with pytest.raises(ValueError, match="src_param and exp_avg must not share memory"):
        step_(buf[:16], g, m, v, source=(m, torch.zeros(16), torch.zeros(16)), **kwargs)
    with pytest.raises(ValueError, match="src_exp_avg and grad must not share memory"):
        step_(buf[:16], g, m, v, source=(torch.zeros(16), g, torch.zeros(16)), **kwargs)
    with pytest.raises(ValueError, match="three tensors"):
        step_(buf[:16], g, m, v, source=(torch.zeros(16),), **kwargs)  # type: ignore[arg-type]


def test_fallback_sumsq() -> None:
    g = torch.randn(1000).bfloat16()
    assert _fallback.grad_sumsq_nonfinite(g) == (pytest.approx(float(g.double().square().sum())), 0)
    g[3] = float("nan")
    assert _fallback.grad_sumsq_nonfinite(g)[1] == 1


_SCRIPT = """
import warnings, torch
warnings.simplefilter("always")
from hf_superoffload import ops
hyper = ops.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    p, m, v = torch.randn(64), torch.zeros(64), torch.zeros(64)
    for step in (1, 2):
        ops.cpu_adamw_step_(p, torch.randn(64).bfloat16(), m, v, step=step, hyper=hyper,
                            param_bf16_out=torch.empty(64, dtype=torch.bfloat16))
    dst = (torch.empty(64), torch.empty(64), torch.empty(64))
    ops.cpu_adamw_step_(dst[0], torch.randn(64), dst[1], dst[2], step=3, hyper=hyper,
                        source=(p, m, v))
    assert not torch.equal(dst[0], p) and torch.isfinite(torch.cat(dst)).all()
    sumsq, bad = ops.grad_sumsq_nonfinite(torch.ones(10))
    assert (sumsq, bad) == (10.0, 0)
    print(ops.backend())
runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
print(len(runtime))
for w in runtime:
    print(str(w.message).replace("\\n", " "))
"""


def _run(env_extra: dict[str, str]) -> list[str]:
    env = {**os.environ, **env_extra}
    # cwd: a checkout's root would shadow the installed (or staged) package, which alone holds cpu_ext
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tempfile.gettempdir())
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()


def test_disable_env_forces_the_fallback_silently() -> None:
    lines = _run({"HF_SUPEROFFLOAD_DISABLE_CPU_EXT": "1"})
    assert lines[:2] == ["torch-fallback", "0"]


def test_build_failure_falls_back_with_one_warning(tmp_path: Path) -> None:
    lines = _run({"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")})
    assert lines[:2] == ["torch-fallback", "1"], lines
    message = lines[2]
    assert "could not build the CPU Adam extension" in message
    assert "g++" in message and "ninja" in message
