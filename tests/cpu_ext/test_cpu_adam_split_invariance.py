"""The CPU kernels give the same bits however the elements are split ([Note: determinism] in docs/design.md).

The engine steps a bucket's runs on ``cpu_threads`` threads, in chunks whose ends fall anywhere in a run, and the
head/body/tail split of each chunk depends on its offset and length (and on the buffers' alignment): an element
must come out the same whether it lands in a SIMD body, a masked head or a scalar tail, on any path. The sum of
squares behind the gradient norm (host accumulation) must not depend on the thread count, the SIMD path or the
backend either ([Note: fixed-order sums] in cpu_ext/csrc/kernels_common.h).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_superoffload import ops
from hf_superoffload.ops import AdamWHyper

_fallback = importlib.import_module("hf_superoffload.cpu_ext._fallback")

SIZES = (1, 7, 17, 31, 33, 1001, 70001, 2**20 + 7)
"""Odd lengths: all tail, one body and a tail, several threads' chunks (>= 2 x 32Ki), streamed stores (>= 2**20)."""
STEP = {"step": 5, "hyper": AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
         "grad_scale": 0.37}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _cuts(n: int) -> list[int]:
    """Where a call is split in two: past a head, mid-vector, just past a thread's share."""
    return sorted({c for c in (1, 3, 17, n // 2 + 5, 32 * 1024 + 9, n - 13) if 0 < c < n})


def _run(n: int, grad_dtype: torch.dtype, out_of_place: bool, mode: str, pieces: list[tuple[int, int, int]],
         shift: int) -> list[torch.Tensor]:
    """Step elements [lo, hi) with ``threads`` for each piece; the state sits ``shift`` elements into its buffers
    (another alignment). ``mode``: "full"; "deferred" (p and bf16 first, the moments stored afterwards); "late"
    (bf16 only, then the full step commits). Returns p, m, v and the bf16 copy."""
    gen = torch.Generator().manual_seed(n)
    p0, m0 = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen)
    v0, g = 0.01 * torch.rand(n, generator=gen), (3 * torch.randn(n, generator=gen)).to(grad_dtype)

    def buf(x: torch.Tensor | None) -> torch.Tensor:
        b = torch.full((n + shift,), float("nan"))[shift:]
        if x is not None:
            b.copy_(x)
        return b

    src = (buf(p0), buf(m0), buf(v0))
    dst = (buf(None), buf(None), buf(None)) if out_of_place else src
    out = torch.zeros(n + shift, dtype=torch.bfloat16)[shift:]
    for lo, hi, threads in pieces:
        sl = slice(lo, hi)
        source = tuple(t[sl] for t in src) if out_of_place else None
        args = (dst[0][sl], g[sl], dst[1][sl], dst[2][sl])
        if mode == "full":
            ops.cpu_adamw_step_(*args, **STEP, param_bf16_out=out[sl], source=source, num_threads=threads)
        elif mode == "deferred":
            ops.cpu_adamw_step_(*args, **STEP, param_bf16_out=out[sl], source=source, num_threads=threads,
                                store_moments=False)
            ops.cpu_adamw_moments_(g[sl], dst[1][sl], dst[2][sl], hyper=STEP["hyper"], grad_scale=STEP["grad_scale"],
                                   source=source[1:] if source else None, num_threads=threads)
        else:
            ops.cpu_adamw_step_(*args, **STEP, param_bf16_out=out[sl], source=source, num_threads=threads,
                                store_moments=False, store_master=False)
            ops.cpu_adamw_step_(*args, **STEP, source=source, num_threads=threads)
    return [*dst, out]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("grad_dtype", "out_of_place"), [(torch.bfloat16, True), (torch.float32, False)])
def test_step_bits_do_not_depend_on_threads_offsets_or_alignment(isa: str, n: int, grad_dtype: torch.dtype,
                                                                 out_of_place: bool) -> None:
    want = [_bits(t) for t in _run(n, grad_dtype, out_of_place, "full", [(0, n, 1)], 0)]
    cuts = _cuts(n) if n < 2**20 else _cuts(n)[-2:]  # the large size only for its thread shares and streaming
    cases: list[tuple[str, list[tuple[int, int, int]], int]] = [("full", [(0, n, threads)], 0) for threads in (2, 3)]
    cases += [("full", [(0, c, 1), (c, n, 3)], k % 2 * 3) for k, c in enumerate(cuts)]
    cases += [(mode, [(0, c, 2), (c, n, 1)], 1) for mode in ("deferred", "late") for c in cuts[:2]]
    if n == 1:
        cases += [("deferred", [(0, 1, 2)], 1), ("late", [(0, 1, 2)], 1)]
    for mode, pieces, shift in cases:
        got = _run(n, grad_dtype, out_of_place, mode, pieces, shift)
        for name, a, b in zip(("p", "m", "v", "bf16"), want, got, strict=True):
            assert torch.equal(a, _bits(b)), (
                f"{isa}: {name} differs when stepped as {pieces} ({mode}, shift {shift}) instead of in one call "
                f"on one thread ({int((a != _bits(b)).sum())} of {n})")


def test_every_path_gives_the_scalar_bits(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is one rounding sequence on every ISA ([Note: one rounding sequence for every path])."""
    n = 4099
    results = {}
    for name in torch.ops.hf_superoffload.cpu_adam_supported_isas():
        monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_ADAM_ISA", name)
        results[name] = [_bits(t) for t in _run(n, torch.bfloat16, True, "full", [(0, 1029, 1), (1029, n, 2)], 3)]
    for name, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(results["scalar"], got, strict=True)), name


def _grads(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (3 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sumsq_does_not_depend_on_the_thread_count(isa: str, dtype: torch.dtype) -> None:
    # several blocks and uneven per-thread shares: a per-thread partial sum changes with the thread count
    for n, seed in ((1_000_003, 0), (700_001, 1), (2**18 + 5, 2)):
        g = _grads(n, dtype, seed)
        sums = {t: ops.grad_sumsq_nonfinite(g, num_threads=t) for t in range(1, 9)}
        assert len(set(sums.values())) == 1, f"{isa} n={n}: {sums}"


@pytest.mark.parametrize("n", [1, 31, 33, 65537, 1_000_003])
def test_sumsq_is_the_same_on_every_path_and_in_the_fallback(compiled: None, monkeypatch: pytest.MonkeyPatch,
                                                             n: int) -> None:
    g = _grads(n, torch.bfloat16, n)
    want = _fallback.grad_sumsq_nonfinite(g)
    for name in torch.ops.hf_superoffload.cpu_adam_supported_isas():
        monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_ADAM_ISA", name)
        assert ops.grad_sumsq_nonfinite(g, num_threads=2) == want, name


def test_fallback_sumsq_does_not_depend_on_torch_threads() -> None:
    g = _grads(3_000_001, torch.float32, 7)
    before = torch.get_num_threads()
    try:
        sums = set()
        for t in (1, 2, 3, 4):
            torch.set_num_threads(t)
            sums.add(_fallback.grad_sumsq_nonfinite(g))
    finally:
        torch.set_num_threads(before)
    assert len(sums) == 1, sums
