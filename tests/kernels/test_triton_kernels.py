"""Triton kernels vs torch and their eager twins, on CPU through the interpreter and on CUDA natively.

Triton picks interpreter-or-compiler once per process, when ``triton`` is first imported, so this module
sets ``TRITON_INTERPRET=1`` before anything imports it -- unless a GPU is present, where the compiled
kernels are the thing worth testing (then :class:`TestInterpreter` is skipped and :class:`TestCuda` runs the
same checks natively). The variable is given back right after the import and set again only while this
module's tests run (the dispatcher reads it per call), so other test modules in the same pytest process
keep running the twins on CPU.

Every check asserts that the Triton path was actually taken (:func:`last_backend`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import torch

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
_INTERPRETER = not torch.cuda.is_available()  # torch does not import triton
if _INTERPRETER:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402,F401  -- imported here on purpose: after TRITON_INTERPRET is set
from hf_superoffload.cpu_ext import AdamWHyper  # noqa: E402
from hf_superoffload.triton_kernels import _configs  # noqa: E402
from hf_superoffload.triton_kernels import reference as ref  # noqa: E402

from hf_superoffload import triton_kernels as tk  # noqa: E402

_STATUS = tk.triton_status()  # imports the kernels now, in the mode chosen above
if _PREV_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

BIG = 2**20 + 3  # the large odd size; keep the interpreter time sane (~1 s per kernel call)



def _family_configs(*families: str) -> list[_configs.RowsConfig]:
    """Every launch config the size tables or the benchmark sweep can pick for these op families; under the
    interpreter (CI: each big-tile config costs 20-85 s there) every table config and one sweep candidate per
    code path (``_configs.one_per_path``), natively all of them."""
    sweep = [c for fam in families for c in _configs.sweep_candidates(fam)]
    return sorted(
        set(_configs.one_per_path(sweep) if _INTERPRETER else sweep)
        | {c for fam in families for _, c in _configs.HEURISTIC[fam]},
        key=lambda c: c.tag,
    )


# Each forced in turn below, per op (each family has its own table: a flatten config never runs a scatter).
FLATTEN_CONFIGS = _family_configs("flatten", "flatten_spread")
SCATTER_CONFIGS = _family_configs("scatter", "scatter_sr")
ALL_CONFIGS = sorted(set(FLATTEN_CONFIGS) | set(SCATTER_CONFIGS), key=lambda c: c.tag)
_NEW_FIELDS_AT_DEFAULT = dict(epilogue="loop", stream=False, min_per_program=0, interleave=0)
# Kernel 2's configs (those of the fixed-cost variants through SMALL_VARIANTS below: they leave kernel 2's
# tile paths as they are), plus small tiles on one or two warps (many tiles, rows and programs on small
# inputs; one program per 512-element row with a second reduction launch).
K2_CONFIGS = [
    c
    for c in ALL_CONFIGS
    if c.kernel == 2 and all(getattr(c, f) == v for f, v in _NEW_FIELDS_AT_DEFAULT.items())
] + [
    _configs.RowsConfig(0, 256, 1, 8, kernel=2, packed=True),
    _configs.RowsConfig(0, 256, 2, 8, kernel=2),
    _configs.RowsConfig(512, 256, 2, 0, one_pass=False, kernel=2, packed=True),
]
# The fixed-cost variants (epilogue, stream, min_per_program, interleave) at sizes where they act on the small
# forced-config layouts (2 stand-in SMs under the interpreter): programs with several interleaved pieces, a grid
# capped by min_per_program, a wide epilogue over one program per 512-element row.
SMALL_VARIANTS = [
    _configs.RowsConfig(0, 256, 1, 8, kernel=2, packed=True, epilogue="wide", interleave=128),
    _configs.RowsConfig(0, 256, 2, 8, epilogue="wide", interleave=256),
    _configs.RowsConfig(0, 256, 2, 4, epilogue="wide", stream=True, interleave=256, min_per_program=1024),
    _configs.RowsConfig(512, 256, 2, 0, kernel=2, packed=True, epilogue="wide", stream=True),
    _configs.RowsConfig(0, 256, 2, 8, kernel=2, stream=True, min_per_program=2048),
    # the dependent launch (a plain launch off sm_90+): a persistent kernel 1, and kernel 2 with a second
    # (plain) reduction launch after it
    _configs.RowsConfig(0, 256, 2, 8, stream=True, pdl=True),
    _configs.RowsConfig(512, 256, 2, 0, one_pass=False, kernel=2, packed=True, stream=True, pdl=True),
]
K2_CONFIGS += [c for c in SMALL_VARIANTS if c.kernel == 2]
# realign (rows not aligned on both sides as whole vectors) on small tiles: many vector rows, a masked last
# tile, and one program per 512-element row with a second reduction launch
REALIGN_CONFIGS = [
    _configs.RowsConfig(0, 256, 1, 8, kernel=2, packed=True, realign=True),
    _configs.RowsConfig(512, 256, 2, 0, one_pass=False, kernel=2, packed=True, realign=True),
    # lookahead: the next whole tile's loads ahead of this one's store (rows of 2+ whole tiles: the loop runs)
    _configs.RowsConfig(0, 256, 1, 8, kernel=2, packed=True, realign=True, lookahead=True),
    _configs.RowsConfig(512, 256, 2, 0, one_pass=False, kernel=2, packed=True, realign=True, lookahead=True),
]
K2_CONFIGS += [*REALIGN_CONFIGS, _configs.RowsConfig(0, 256, 1, 8, kernel=2, packed=True, lookahead=True)]
# Kernel 3 (the rows as arguments): the tables' and sweep's, plus small tiles on one or two warps, several tiles
# per program (the unrolled tile loop) and the streaming hints.
K3_CONFIGS = [c for c in ALL_CONFIGS if c.kernel == 3] + [
    _configs.RowsConfig(256, 256, 1, 0, kernel=3, packed=True),
    _configs.RowsConfig(1024, 256, 2, 0, kernel=3),
    _configs.RowsConfig(1024, 256, 2, 0, kernel=3, packed=True, stream=True),
    _configs.RowsConfig(1024, 256, 2, 0, kernel=3, packed=True, stream=True, pdl=True),  # a plain launch off sm_90+
]
# The fixed-cost variants on large tiles, for the 2**20 + 3 flatten, with a source dtype: kernel 1 with
# several pieces per program (16 programs under the interpreter), kernel 2 on a grid of 4 capped by
# min_per_program, each program with several pieces.
BIG_VARIANTS = [
    (_configs.RowsConfig(0, 4096, 4, 8, epilogue="wide", stream=True, interleave=8192), torch.float32),
    (
        _configs.RowsConfig(
            0, 8192, 4, 8, kernel=2, packed=True, epilogue="wide", min_per_program=262144, interleave=8192
        ),
        torch.bfloat16,
    ),
]


@pytest.fixture(autouse=True)
def _interpret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_SUPEROFFLOAD_DISABLE_TRITON", raising=False)
    if _INTERPRETER:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# ----------------------------------------------------------------------------------------- helpers


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> fp32 with those bit patterns."""
    b = bits & 0xFFFF_FFFF
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def special_f32(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` fp32 values stressing fp32 -> bf16 rounding: random bit patterns (denormals, NaN payloads,
    huge values), exact ties with even and odd kept bits, near-ties, denormals, +-0, +-Inf, NaNs, values
    that round up to Inf, plus ordinary normals at many scales."""
    k = n // 6

    def rint(lo: int, hi: int, size: int) -> torch.Tensor:
        return torch.randint(lo, hi, (size,), generator=gen, dtype=torch.int64)

    parts = [
        rint(0, 2**32, k),  # any pattern at all
        (rint(0, 2**16, k) << 16) | 0x8000,  # exact ties, kept LSB even or odd
        (rint(0, 2**16, k) << 16) | torch.tensor([0x7FFF, 0x8001, 0x0000, 0xFFFF, 0x0001])[rint(0, 5, k)],
        rint(0, 2, k) << 31 | rint(0, 2**23, k),  # denormals (and zeros), both signs
    ]
    specials = torch.tensor(
        [0x0, 0x8000_0000, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFFBF_FFFF,
         0x7FFF_FFFF, 0x7F7F_FFFF, 0xFF7F_FFFF, 0x7F7F_8000, 0x7F7F_7FFF, 0x0080_0000, 0x007F_FFFF,
         0x0000_8000, 0x0001_8000, 0x3F80_8000, 0x3F81_8000],
        dtype=torch.int64,
    )  # fmt: skip
    parts.append(specials.repeat(max(1, k // len(specials))))
    out = torch.cat([_bits_to_f32(p) for p in parts])
    scales = torch.pow(10.0, torch.randint(-40, 38, (n - out.numel(),), generator=gen).double())
    normals = (torch.randn(n - out.numel(), generator=gen, dtype=torch.float64) * scales).float()
    return torch.cat([out, normals])[torch.randperm(n, generator=gen)]


def assert_bf16_bitwise(out: torch.Tensor, src: torch.Tensor, expected: torch.Tensor) -> None:
    """Non-NaN values bit for bit; NaN inputs give a quiet NaN of the same sign."""
    a = out.view(torch.int16).cpu().to(torch.int64) & 0xFFFF
    b = expected.view(torch.int16).cpu().to(torch.int64) & 0xFFFF
    nan = torch.isnan(src).cpu()
    mism = (a != b) & ~nan
    assert not mism.any(), (
        f"{int(mism.sum())} mismatches, first src bits "
        f"{hex(int(src.cpu().view(torch.int32)[mism][0]) & 0xFFFFFFFF)}: got {hex(int(a[mism][0]))} "
        f"want {hex(int(b[mism][0]))}"
    )
    assert torch.isnan(out.float().cpu()[nan]).all()
    assert ((a[nan] & 0x40) != 0).all(), "NaN not quiet"
    src_sign = src.cpu().view(torch.int32)[nan] < 0
    assert torch.equal((a[nan] & 0x8000) != 0, src_sign), "NaN sign not kept"


def assert_stats(stats: torch.Tensor, expected: torch.Tensor) -> None:
    s, e = stats.cpu(), expected.cpu()
    torch.testing.assert_close(s[0], e[0], rtol=1e-5, atol=0.0, equal_nan=True)
    assert s[1].item() == e[1].item(), (s, e)


def _slice_of(flat: torch.Tensor, params: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """The slice of ``flat`` that ``scatter_flat_`` copies into ``p`` (one of ``params``)."""
    off = 0
    for q in params:
        if q is p:
            return flat[off : off + q.numel()]
        off += q.numel()
    raise AssertionError("p is not in params")


def random_shapes(n: int, gen: torch.Generator) -> list[tuple[int, ...]]:
    shapes = []
    for _ in range(n):
        nd = int(torch.randint(1, 4, (1,), generator=gen))
        shapes.append(tuple(int(d) for d in torch.randint(1, 24, (nd,), generator=gen)))
    return shapes


# ------------------------------------------------------------------------------------------ checks


class _KernelChecks:
    """The checks; subclasses pick the device. Every test asserts the Triton path was taken."""

    device = "cpu"

    def gen(self, seed: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def t(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device)

    # ---- flatten

    @pytest.mark.parametrize("n", [1, 127, BIG])
    @pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
    def test_flatten_odd_sizes(self, n: int, src_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
        gen = self.gen(n)
        sizes = [n, 3]
        grads = [self.t(torch.randn(n, generator=gen).to(src_dtype)), self.t(torch.randn(3, generator=gen))]
        out = self.t(torch.full((n + 3,), 7.0, dtype=out_dtype))
        stats = self.t(torch.zeros(2))
        tk.flatten_grads_with_stats_(grads, sizes, out, stats)
        assert tk.last_backend("flatten_grads_with_stats_") == "triton"
        exp_out = torch.empty_like(out)
        exp_stats = torch.zeros_like(stats)
        ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
        assert torch.equal(out.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                           exp_out.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))  # fmt: skip
        assert_stats(stats, exp_stats)
        f = torch.cat([g.reshape(-1).to(out_dtype).double() for g in grads])
        torch.testing.assert_close(stats[0].double().cpu(), (f * f).sum().cpu(), rtol=1e-5, atol=0.0)

    def test_flatten_many_small_mixed(self) -> None:
        gen = self.gen(1)
        shapes = random_shapes(50, gen)
        dtypes = [torch.float32, torch.bfloat16, torch.float16]
        grads: list[torch.Tensor | None] = []
        for i, s in enumerate(shapes):
            if i % 7 == 3:
                grads.append(None)
                continue
            g = torch.randn(s, generator=gen).to(dtypes[i % 3])
            if i % 5 == 0 and len(s) >= 2:
                g = torch.randn(tuple(reversed(s)), generator=gen).to(dtypes[i % 3]).transpose(0, -1)
                assert not g.is_contiguous()
            grads.append(self.t(g))
        sizes = [int(np.prod(s)) for s in shapes]
        for out_dtype in (torch.bfloat16, torch.float32):
            out = self.t(torch.full((sum(sizes),), float("nan"), dtype=out_dtype))
            stats = self.t(torch.tensor([1.5, 2.0]))
            tk.flatten_grads_with_stats_(grads, sizes, out, stats)
            assert tk.last_backend("flatten_grads_with_stats_") == "triton"
            exp_out = torch.empty_like(out)
            exp_stats = self.t(torch.tensor([1.5, 2.0]))
            ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
            assert torch.equal(out, exp_out)
            assert_stats(stats, exp_stats)

    def test_flatten_none_grads_and_no_stats(self) -> None:
        out = self.t(torch.full((10,), 3.0, dtype=torch.bfloat16))
        stats = self.t(torch.tensor([4.0, 1.0]))
        tk.flatten_grads_with_stats_([None, None], [4, 6], out, stats)
        assert tk.last_backend("flatten_grads_with_stats_") == "triton"
        assert torch.equal(out.float().cpu(), torch.zeros(10))
        assert stats.cpu().tolist() == [4.0, 1.0]
        g = self.t(torch.randn(6, generator=self.gen()))
        out.fill_(3.0)
        tk.flatten_grads_with_stats_([None, g], [4, 6], out, None)
        assert tk.last_backend("flatten_grads_with_stats_") == "triton"
        assert torch.equal(out[4:], g.to(torch.bfloat16)) and not out[:4].any()

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the interpreter
    def test_flatten_nonfinite_and_accumulation(self) -> None:
        gen = self.gen(2)
        a = torch.randn(1000, generator=gen)
        a[[3, 500, 999]] = torch.tensor([float("inf"), float("-inf"), float("inf")])
        b = torch.randn(77, generator=gen).bfloat16()
        b[10] = float("nan")
        c = torch.tensor([3.4e38, -3.39e38, 1.0])  # the first rounds to bf16 inf: counted, like torch
        grads = [self.t(a), self.t(b), self.t(c)]
        sizes = [1000, 77, 3]
        out = self.t(torch.empty(1080, dtype=torch.bfloat16))
        stats = self.t(torch.zeros(2))
        exp_out, exp_stats = torch.empty_like(out), torch.zeros_like(stats)
        for _ in range(2):  # accumulation across two calls
            tk.flatten_grads_with_stats_(grads, sizes, out, stats)
            assert tk.last_backend("flatten_grads_with_stats_") == "triton"
            ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
        assert torch.equal(out.view(torch.int16), exp_out.view(torch.int16))
        assert torch.isnan(stats[0]) and stats[1].item() == 2 * 5
        assert_stats(stats, exp_stats)
        # inf only (no NaN): the sum of squares is +inf, the count exact
        stats.zero_()
        tk.flatten_grads_with_stats_(grads[:1], sizes[:1], out[:1000], stats)
        assert stats.cpu().tolist() == [float("inf"), 3.0]
        # finite only, accumulated onto a non-zero start
        stats.copy_(torch.tensor([10.0, 1.0]))
        g = self.t(torch.randn(BIG // 8, generator=gen))
        tk.flatten_grads_with_stats_([g], [g.numel()], self.t(torch.empty(g.numel())), stats)
        exp = 10.0 + float((g.double() ** 2).sum())
        assert stats[1].item() == 1.0
        assert abs(stats[0].item() - exp) <= 1e-5 * exp

    def test_flatten_table_cache_and_errors(self) -> None:
        from hf_superoffload.triton_kernels import _kernels

        grads = [self.t(torch.randn(5)), self.t(torch.randn(9))]
        out = self.t(torch.empty(14, dtype=torch.bfloat16))
        tk.flatten_grads_with_stats_(grads, [5, 9], out, None)
        hits = _kernels._flatten_plans.hits
        tk.flatten_grads_with_stats_(grads, [5, 9], out, None)
        assert _kernels._flatten_plans.hits == hits + 1
        with pytest.raises(ValueError):
            tk.flatten_grads_with_stats_(grads, [5, 8], out, None)
        with pytest.raises(ValueError):
            tk.flatten_grads_with_stats_(grads, [4, 10], out, None)

    @pytest.mark.parametrize("bucket_start", [0, 3])
    def test_flatten_scatter_misaligned_views(self, bucket_start: int) -> None:
        """Sources and destinations at every mix of 16-byte (mis)alignment, each long enough to run whole
        unmasked tiles (the kernels pick vector or scalar tiles per row from its alignment)."""
        gen = self.gen(12)
        store32 = self.t(torch.randn(40_000, generator=gen))
        store16 = store32.to(torch.bfloat16)
        # (start, numel); even entries view a bf16 storage, odd ones an fp32 one; no overlaps within one
        spans = [(0, 4104), (1, 4100), (4113, 4099), (4108, 4096), (8232, 5000), (8211, 8200)]
        grads = [(store32 if i % 2 else store16)[a : a + n] for i, (a, n) in enumerate(spans)]
        sizes = [n for _, n in spans]
        total = sum(sizes)
        bucket = self.t(torch.empty(total + 8, dtype=torch.bfloat16))[bucket_start : bucket_start + total]
        stats = self.t(torch.zeros(2))
        tk.flatten_grads_with_stats_(grads, sizes, bucket, stats)
        assert tk.last_backend("flatten_grads_with_stats_") == "triton"
        exp, exp_stats = torch.empty_like(bucket), torch.zeros_like(stats)
        ref.flatten_grads_with_stats_(grads, sizes, exp, exp_stats)
        assert torch.equal(bucket.view(torch.int16), exp.view(torch.int16))
        assert_stats(stats, exp_stats)
        # scatter back: params are views of one bf16 / fp32 storage at the same odd starts
        flat = self.t(torch.randn(total + 8, generator=gen))[bucket_start : bucket_start + total]
        p16 = self.t(torch.zeros(40_000, dtype=torch.bfloat16))
        p32 = self.t(torch.zeros(40_000))
        params = [(p32 if i % 2 else p16)[a : a + n] for i, (a, n) in enumerate(spans)]
        tk.scatter_flat_(flat, params, stochastic_rounding=bucket_start == 3, seed=5)
        assert tk.last_backend("scatter_flat_") == "triton"
        off = 0
        for p in params:
            want = flat[off : off + p.numel()]
            if p.dtype == torch.float32 or bucket_start == 0:
                assert torch.equal(p, want.to(p.dtype))
            else:  # stochastic: one of the two neighbours
                assert ((p.double() - want.double()).abs() <= (want.abs().double() * 2**-7)).all()
            off += p.numel()

    # ---- every launch config, forced

    def _mixed_layout(self, cfg: _configs.RowsConfig, seed: int) -> list[int]:
        """Sizes that give rows of every kind under ``cfg``: a 1 and a 127 (tail-only rows), many small
        tensors (more rows than a persistent grid has programs), entries of several whole chunks (or program
        shares) plus a tail at odd bucket offsets (unaligned rows, shares cut inside them), a whole-tile
        multiple."""
        gen = self.gen(seed)
        # under the interpreter (CI) only as many as a persistent grid of 2 stand-in SMs needs: each row costs a
        # program or a share there, at ~0.1 s apiece
        n_small = max(12, 2 * _configs.INTERP_SMS * cfg.programs_per_sm) if _INTERPRETER else 40
        small = [int(x) for x in torch.randint(1, 300, (n_small,), generator=gen)]
        chunk = cfg.chunk or 4 * cfg.block
        return [1, 127, *small, 2 * chunk + 5, cfg.block * 3, chunk + cfg.block // 2 + 1, 8]

    @pytest.mark.parametrize("cfg", FLATTEN_CONFIGS + SMALL_VARIANTS, ids=lambda c: c.tag)
    def test_flatten_forced_config(self, cfg: _configs.RowsConfig) -> None:
        sizes = self._mixed_layout(cfg, 21)
        gen = self.gen(22)
        dtypes = [torch.bfloat16, torch.float32, torch.float16]
        grads: list[torch.Tensor | None] = []
        for i, n in enumerate(sizes):
            g = torch.randn(n, generator=gen).to(dtypes[i % 3])
            if i == 7:
                g[0] = float("inf")
            grads.append(None if i % 11 == 5 else self.t(g))
        out = self.t(torch.full((sum(sizes),), 7.0, dtype=torch.bfloat16))
        exp_out = torch.empty_like(out)
        exp_stats = self.t(torch.tensor([0.5, 1.0]))
        ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
        with _configs.forced(flatten=cfg, flatten_spread=cfg):
            stats = self.t(torch.tensor([0.5, 1.0]))
            tk.flatten_grads_with_stats_(grads, sizes, out, stats)
            assert tk.last_backend("flatten_grads_with_stats_") == "triton"
            assert torch.equal(out.view(torch.int16), exp_out.view(torch.int16))
            assert_stats(stats, exp_stats)
            assert stats[1].item() == 2.0
            # again: the single-launch reduction's ticket counter was reset, the result is deterministic
            again = self.t(torch.tensor([0.5, 1.0]))
            tk.flatten_grads_with_stats_(grads, sizes, out, again)
            assert torch.equal(again, stats)
            # without statistics, into fp32
            out32 = self.t(torch.empty(sum(sizes)))
            tk.flatten_grads_with_stats_(grads, sizes, out32, None)
            exp32 = torch.empty_like(out32)
            ref.flatten_grads_with_stats_(grads, sizes, exp32, None)
            assert torch.equal(out32, exp32)
            # spread statistics: the same column sums (one row per program, or row 0 when the grid has more
            # programs than rows), the same bits every time, and a second call adds to what is there
            n_rows = tk.spread_stats_rows(out.device, sizes)
            for rows_n in (n_rows, 1):
                rows = self.t(torch.zeros(rows_n, 2))
                rows[0] = self.t(torch.tensor([0.5, 1.0]))
                out.fill_(7.0)
                tk.flatten_grads_with_stats_(grads, sizes, out, rows)
                assert torch.equal(out.view(torch.int16), exp_out.view(torch.int16))
                assert_stats(rows.sum(dim=0), exp_stats)
                again = self.t(torch.zeros(rows_n, 2))
                again[0] = self.t(torch.tensor([0.5, 1.0]))
                tk.flatten_grads_with_stats_(grads, sizes, out, again)
                assert torch.equal(again, rows)
                tk.flatten_grads_with_stats_(grads, sizes, out, again)
                assert again[:, 1].sum().item() == 3.0  # 1 + the two calls' one +Inf each

    @pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
    def test_flatten_spread_statistics(self, src_dtype: torch.dtype) -> None:
        """A persistent grid with enough rows spreads: more than one row is written, NaN / +-Inf in several
        programs' shares are all counted (in more than one row), the finite rows hold no more than the finite
        values' squares; on a finite bucket the rows' total matches float64, and a second call adds to it; the
        bucket's bits are the twin's."""
        cfg = _configs.RowsConfig(0, 256, 2, 8, kernel=2, packed=True)
        gen = self.gen(31)
        sizes = [5, 4099, 1, 20_000, 127, 9_001]
        grads: list[torch.Tensor | None] = [torch.randn(n, generator=gen).to(src_dtype) for n in sizes]
        for i, j, v in ((1, 17, float("nan")), (3, 9_999, float("-inf")), (3, 19_999, float("inf")), (5, 0, 3e38)):
            grads[i][j] = v  # type: ignore[index]
        grads = [self.t(g) for g in grads]  # type: ignore[arg-type]
        out = self.t(torch.empty(sum(sizes), dtype=torch.bfloat16))
        exp_out = torch.empty_like(out)
        ref.flatten_grads_with_stats_(grads, sizes, exp_out, None)
        rows = self.t(torch.zeros(tk.spread_stats_rows(out.device, sizes), 2))
        with _configs.forced(flatten_spread=cfg):
            tk.flatten_grads_with_stats_(grads, sizes, out, rows)
        nan = exp_out.isnan()  # NaN payloads from fp32 differ from torch's (module docs): NaN-ness, other bits
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int16), exp_out[~nan].view(torch.int16))
        written = (rows != 0).any(dim=1)
        assert int(written.sum()) > 1, "the statistics were reduced, not spread"
        assert rows[:, 1].sum().item() == 3.0 and int((rows[:, 1] > 0).sum()) >= 2
        f = exp_out.double()
        fin = torch.isfinite(f)
        finite_rows = rows[rows[:, 1] == 0]
        assert rows[:, 0].isnan().any()  # the NaN's (and the Infs') programs carry NaN / Inf sums
        # the other programs' sums: together those of the values outside the non-finite programs' shares
        assert torch.isfinite(finite_rows[:, 0]).all()
        assert float(finite_rows[:, 0].double().sum()) <= float((f[fin] ** 2).sum()) * (1 + 1e-5)
        # a finite bucket (no square overflows fp32): the rows' total against float64
        finite = [None if g is None else torch.nan_to_num(g, nan=0.0).clamp(-8, 8) for g in grads]
        rows.zero_()
        with _configs.forced(flatten_spread=cfg):
            tk.flatten_grads_with_stats_(finite, sizes, out, rows)
        f = out.double()
        torch.testing.assert_close(rows[:, 0].double().sum(), (f * f).sum(), rtol=1e-5, atol=0.0)
        assert rows[:, 1].sum().item() == 0.0
        with _configs.forced(flatten_spread=cfg):  # a second call adds to every row it writes
            tk.flatten_grads_with_stats_(finite, sizes, out, rows)
        torch.testing.assert_close(rows[:, 0].double().sum(), 2 * (f * f).sum(), rtol=1e-5, atol=0.0)

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy fp16 casts (interpreter)
    @pytest.mark.parametrize("cfg", SCATTER_CONFIGS + SMALL_VARIANTS, ids=lambda c: c.tag)
    def test_scatter_forced_config(self, cfg: _configs.RowsConfig) -> None:
        sizes = self._mixed_layout(cfg, 23)
        gen = self.gen(24)
        dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16]
        params = [self.t(torch.empty(n, dtype=dtypes[i % 4])) for i, n in enumerate(sizes)]
        flat = self.t(special_f32(sum(sizes) + 3, gen))[3:]  # an odd view: unaligned flat rows
        with _configs.forced(scatter=cfg, scatter_sr=cfg):
            tk.scatter_flat_(flat, params)
            assert tk.last_backend("scatter_flat_") == "triton"
            exp = [torch.empty_like(p) for p in params]
            ref.scatter_flat_(flat, exp)
            for p, e in zip(params, exp):
                if p.dtype == torch.bfloat16:
                    assert_bf16_bitwise(p, _slice_of(flat, params, p), e)
                else:  # NaN payloads may differ (fp16): NaN-ness, and every other value exactly
                    nan = e.isnan()
                    assert torch.equal(p.isnan(), nan) and torch.equal(p[~nan], e[~nan])
            # stochastic rounding: the twin's bits exactly (same hash, same counters)
            tk.scatter_flat_(flat, params, stochastic_rounding=True, seed=77, offset=1000)
            ref.scatter_flat_(flat, exp, stochastic_rounding=True, seed=77, offset=1000)
            for p, e in zip(params, exp):
                if p.dtype == torch.bfloat16:
                    assert_bf16_bitwise(p, _slice_of(flat, params, p), e)

    # ---- the fixed-cost variants on the large odd size, and the wide epilogue's loop and int64 counts

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the interpreter
    @pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    @pytest.mark.parametrize(("cfg", "src_dtype"), BIG_VARIANTS, ids=lambda x: getattr(x, "tag", str(x)))
    def test_flatten_big_variants(self, cfg: _configs.RowsConfig, src_dtype: torch.dtype) -> None:
        """2**20 + 3 elements after a 1- and a 127-element entry (odd bucket offsets), NaN / +-Inf / the largest
        finite value at both ends and inside, 100 NaNs in one program: bucket bits, exact count, then the sum
        against float64 without them."""
        gen = self.gen(41)
        sizes = [1, 127, BIG, 8]
        host = [torch.randn(n, generator=gen).to(src_dtype) for n in sizes]
        host[1][5] = float("inf")
        host[2][0], host[2][BIG // 2] = float("nan"), float("-inf")
        host[2][BIG - 1], host[3][7] = 3.0e38, float("inf")
        host[2][1000:1100] = float("nan")  # one program counts 100
        grads = [self.t(g) for g in host]
        with _configs.forced(flatten=cfg):
            stats, exp_stats = self._k2_run(grads, sizes)  # bucket bits, NaN-ness, statistics against the twin
            # 3.0e38 stays finite in bf16 (its square does not in fp32): 104 counted + the start value 1
            assert stats[1].item() == exp_stats[1].item() == 1 + 104 and torch.isnan(stats[0])
            # finite values only: the sum against float64 (run-to-run bits: the forced-config tests)
            host[1][5] = host[2][0] = host[2][BIG // 2] = host[2][BIG - 1] = host[3][7] = 1.5
            host[2][1000:1100] = -0.25
            out, st = self.t(torch.empty(sum(sizes), dtype=torch.bfloat16)), self.t(torch.zeros(2))
            tk.flatten_grads_with_stats_([self.t(g) for g in host], sizes, out, st)
            f = torch.cat([g.to(torch.bfloat16).double() for g in host])
            torch.testing.assert_close(st[0].double().cpu(), (f * f).sum(), rtol=1e-5, atol=0.0)
            assert st[1].item() == 0.0

    @pytest.mark.parametrize("cnt64", [False, True])
    def test_flatten_epilogue_loops_and_wide_counts(self, cnt64: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        """The wide epilogue narrowed to 16 partials per round (a grid of one program per 256-element row
        loops over them); int32 or int64 count sums: the twin's statistics, counters reset between calls."""
        from hf_superoffload.triton_kernels import _kernels

        monkeypatch.setattr(_kernels, "_EPI_MAX", 8)  # per warp: 16 on 2 warps
        if cnt64:
            monkeypatch.setattr(_kernels, "_CNT32_LIMIT", 0)
        cfg = _configs.RowsConfig(256, 256, 2, 0, kernel=2, packed=True, epilogue="wide")
        gen = self.gen(43)
        sizes = [300, 4099, 1, 2560, 77, 2051]  # 1 + 17 + 1 + 10 + 1 + 9 = 39 programs
        host = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        for e, i, v in [(0, 0, float("inf")), (1, 4098, float("nan")), (3, 1000, float("-inf")), (4, 76, float("inf"))]:
            host[e][i] = v
        grads = [self.t(g) for g in host]
        with _configs.forced(flatten=cfg):
            for _ in range(2):
                out = self.t(torch.empty(sum(sizes), dtype=torch.bfloat16))
                stats = self.t(torch.tensor([0.5, 3.0]))
                tk.flatten_grads_with_stats_(grads, sizes, out, stats)
                assert tk.last_backend("flatten_grads_with_stats_") == "triton"
                exp, exp_stats = torch.empty_like(out), self.t(torch.tensor([0.5, 3.0]))
                ref.flatten_grads_with_stats_(grads, sizes, exp, exp_stats)
                assert stats[1].item() == exp_stats[1].item() == 3 + 4 and torch.isnan(stats[0])
            host[1][4098] = host[0][0] = host[3][1000] = host[4][76] = 0.5
            grads = [self.t(g) for g in host]
            stats = self.t(torch.tensor([0.5, 3.0]))
            tk.flatten_grads_with_stats_(grads, sizes, out, stats)
            exp_stats = self.t(torch.tensor([0.5, 3.0]))
            ref.flatten_grads_with_stats_(grads, sizes, exp, exp_stats)
            assert_stats(stats, exp_stats)
            assert torch.equal(out.view(torch.int16), exp.view(torch.int16))

    # ---- kernel 2: non-finite values where its paths meet

    @staticmethod
    def _k2_sizes(block: int) -> list[int]:
        """Entries of a bf16 bucket with rows on every kernel-2 path: aligned entries of whole tiles, a
        masked vector row and a few elements after it (entry 0: 3 tiles + 8 + 5), misaligned entries
        (bucket offsets 3B+13, 5B+17, 6B+27, 10B+57), one-element and 9-element aligned entries."""
        b = block
        return [3 * b + 13, 3, 2 * b, 1, 7, b + 3, 5, 4 * b + 16, 9, 2 * b + 1]

    @staticmethod
    def _k2_specials(block: int) -> list[tuple[int, int, int]]:
        """(entry, index, bf16 bits): first / last element of the bucket, tile boundaries, the last vector
        row and the element after it, both halves of a word, a misaligned entry, a one-element entry;
        NaNs of both signs and with payloads, both infinities, the largest finite bf16 of both signs."""
        b = block
        return [
            (0, 0, 0x7F80), (0, b - 1, 0xFF80), (0, b, 0xFFC1), (0, b + 1, 0x7F7F), (0, 3 * b + 7, 0x7F80),
            (0, 3 * b + 8, 0xFF81), (2, 0, 0x7F80), (2, 1, 0xFF80), (2, 2 * b - 1, 0x7F7F), (3, 0, 0xFF80),
            (4, 3, 0x7FA0), (5, b, 0xFF7F), (7, 2 * b, 0xFF80), (7, 4 * b + 15, 0x7FC0), (8, 8, 0x7F80),
            (9, 2 * b, 0x7FC0),
        ]  # fmt: skip

    def _k2_run(self, grads: list[torch.Tensor], sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel path vs twin on ``grads``: bucket bits equal, count exact, sum of squares close (or both
        NaN / both Inf); returns the kernel's statistics and the twin's."""
        out = self.t(torch.full((sum(sizes),), 7.0, dtype=torch.bfloat16))
        stats = self.t(torch.tensor([0.25, 1.0]))
        tk.flatten_grads_with_stats_(grads, sizes, out, stats)
        assert tk.last_backend("flatten_grads_with_stats_") == "triton"
        exp, exp_stats = torch.empty_like(out), self.t(torch.tensor([0.25, 1.0]))
        ref.flatten_grads_with_stats_(grads, sizes, exp, exp_stats)
        nan = exp.isnan()  # fp32 NaN -> bf16 payloads differ from torch's (see _kernels): NaN-ness there
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out.view(torch.int16)[~nan], exp.view(torch.int16)[~nan])
        assert_stats(stats, exp_stats)
        return stats.cpu(), exp_stats.cpu()

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the interpreter
    @pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    @pytest.mark.parametrize("cfg", K2_CONFIGS, ids=lambda c: c.tag)
    def test_flatten_k2_nonfinite_placement(self, cfg: _configs.RowsConfig) -> None:
        sizes = self._k2_sizes(cfg.block)
        specials = self._k2_specials(cfg.block)
        gen = self.gen(31)
        base = [torch.randn(n, generator=gen).bfloat16() for n in sizes]

        def with_bits(pick: list[tuple[int, int, int]]) -> list[torch.Tensor]:
            gs = [g.clone() for g in base]
            for e, i, bits in pick:
                gs[e].view(torch.int16)[i] = bits - 0x10000 if bits >= 0x8000 else bits
            return [self.t(g) for g in gs]

        def nonfinite(pick: list[tuple[int, int, int]]) -> int:
            return sum((bits & 0x7F80) == 0x7F80 for _, _, bits in pick)

        with _configs.forced(flatten=cfg):
            # every special: NaN sum, the count exact (one start value of 1 included), deterministic bits
            gs = with_bits(specials)
            s, _ = self._k2_run(gs, sizes)
            assert torch.isnan(s[0]) and s[1].item() == 1 + nonfinite(specials) == 1 + 13
            again, _ = self._k2_run(gs, sizes)
            assert torch.equal(again.view(torch.int32), s.view(torch.int32))
            # infinities and the largest finite values, no NaN: the sum is +inf, the count still exact
            no_nan = [(e, i, b) for e, i, b in specials if not ((b & 0x7F80) == 0x7F80 and b & 0x7F)]
            s, _ = self._k2_run(with_bits(no_nan), sizes)
            assert s[0].item() == float("inf") and s[1].item() == 1 + nonfinite(no_nan) == 1 + 8
            # only the largest finite values: their squares overflow fp32, yet none is counted
            finite = [(e, i, b) for e, i, b in specials if (b & 0x7F80) != 0x7F80]
            s, _ = self._k2_run(with_bits(finite), sizes)
            assert s[0].item() == float("inf") and s[1].item() == 1.0
            # finite values: the sum against float64, twice bitwise
            gs = with_bits([])
            s, _ = self._k2_run(gs, sizes)
            f = torch.cat([g.cpu().double() for g in gs])
            torch.testing.assert_close(s[0].double() - 0.25, (f * f).sum(), rtol=1e-5, atol=0.0)
            assert s[1].item() == 1.0
            assert torch.equal(self._k2_run(gs, sizes)[0], s)
            # fp32 sources on the same layout (kernel 2's unpacked paths): values that round to inf count
            g32 = [g.float() for g in base]
            for e, i, v in [(0, 0, float("inf")), (0, cfg.block, float("nan")), (2, 1, 3.4e38),
                            (5, cfg.block, -3.39e38), (9, 2 * cfg.block, float("-inf"))]:  # fmt: skip
                g32[e][i] = v
            s, e_ = self._k2_run([self.t(g) for g in g32], sizes)
            assert torch.isnan(s[0]) and s[1].item() == e_[1].item() == 1 + 4

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, under the interpreter
    @pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    @pytest.mark.parametrize("cfg", REALIGN_CONFIGS, ids=lambda c: c.tag)
    @pytest.mark.parametrize("bucket_start", range(8))
    def test_flatten_realign_phases(self, cfg: _configs.RowsConfig, bucket_start: int) -> None:
        """bf16 gradients that are views at every phase of a 16-byte vector, into a bucket at every phase:
        each source / destination phase difference (realign's shifts 0..7). NaN / +-Inf at the first and
        last element of entries, around the head (< 16 elements), the vector run and the tail; bucket bits
        and exact counts against the twin, deterministic statistics."""
        gen = self.gen(51 + bucket_start)
        sizes = [700, 1, 613, 1000, 37, 2 * cfg.block + 11, 16, 23, 24, cfg.block + 9]
        buf = torch.randn(sum(sizes) + 8 * len(sizes), generator=gen).bfloat16()
        views, at = [], 0
        for i, n in enumerate(sizes):
            at += (3 * i + bucket_start) % 8  # source phases 0..7
            views.append(buf[at : at + n])
            at += n
        bits = {0x7F80: 1, 0xFF80: 1, 0x7FC1: 1, 0x7F7F: 0, 0xFFFF: 1}
        for e, n in enumerate(sizes):
            for k, i in enumerate(sorted({0, n - 1, min(7, n - 1), min(15, n - 1), n // 2, max(n - 9, 0)})):
                b = list(bits)[(e + k) % len(bits)]
                views[e].view(torch.int16)[i] = b - 0x10000 if b >= 0x8000 else b
        expect_bad = sum(bits[int(v) & 0xFFFF] for g in views for v in g.view(torch.int16) if int(v) & 0xFFFF in bits)
        bucket = self.t(torch.full((sum(sizes) + bucket_start,), 7.0, dtype=torch.bfloat16))
        out = bucket[bucket_start:]
        grads = [self.t(g) for g in views]
        with _configs.forced(flatten=cfg):
            stats = self.t(torch.tensor([0.25, 1.0]))
            tk.flatten_grads_with_stats_(grads, sizes, out, stats)
            assert tk.last_backend("flatten_grads_with_stats_") == "triton"
            exp, exp_stats = torch.empty_like(out), self.t(torch.tensor([0.25, 1.0]))
            ref.flatten_grads_with_stats_(grads, sizes, exp, exp_stats)
            assert torch.equal(out.view(torch.int16), exp.view(torch.int16))
            assert torch.equal(bucket[:bucket_start].view(torch.int16).cpu(),
                               torch.full((bucket_start,), 7.0).bfloat16().view(torch.int16))  # fmt: skip
            assert stats[1].item() == exp_stats[1].item() == 1 + expect_bad and torch.isnan(stats[0])
            again = self.t(torch.tensor([0.25, 1.0]))
            tk.flatten_grads_with_stats_(grads, sizes, out, again)
            assert torch.equal(again.view(torch.int32), stats.view(torch.int32))
            # finite values: the sum against float64
            fin = [g.clone() for g in views]
            for g in fin:
                g[~torch.isfinite(g.float()) | (g.float().abs() > 1e30)] = 0.5  # 0x7F7F squared: inf in fp32
            st = self.t(torch.zeros(2))
            tk.flatten_grads_with_stats_([self.t(g) for g in fin], sizes, out, st)
            f = torch.cat([g.double() for g in fin])
            torch.testing.assert_close(st[0].double().cpu(), (f * f).sum(), rtol=1e-5, atol=0.0)
            assert st[1].item() == 0.0

    @pytest.mark.parametrize("cfg", REALIGN_CONFIGS[:2], ids=lambda c: c.tag)
    @pytest.mark.parametrize("bucket_start", [0, 3])
    def test_realign_fp32_side(self, cfg: _configs.RowsConfig, bucket_start: int) -> None:
        """Realigned rows with an fp32 side (destination-aligned tiles, the source element by element): fp32
        gradients into a bf16 bucket and bf16 gradients into an fp32 bucket at odd offsets (every destination
        phase over the rows), reduced and spread statistics with NaN / Inf in the tiles; the scatter from an
        fp32 bucket at an odd offset, RNE and stochastic rounding. Bits and exact counts against the twin;
        rows of many whole tiles, so persistent programs get whole tiles too."""
        gen = self.gen(61 + bucket_start)
        sizes = [700, 1, 613, 1000, 37, 2 * cfg.block + 11, 16, 23, 24, cfg.block + 9, 40 * cfg.block + 5]
        for src_dtype, out_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
            grads = [torch.randn(n, generator=gen).to(src_dtype) for n in sizes]
            for e, i, v in [(5, 300, float("inf")), (10, 7 * cfg.block + 3, float("nan")), (3, 999, float("-inf"))]:
                grads[e][i] = v
            grads = [self.t(g) for g in grads]
            bucket = self.t(torch.full((sum(sizes) + bucket_start,), 7.0, dtype=out_dtype))
            out = bucket[bucket_start:]
            exp, exp_stats = torch.empty_like(out), self.t(torch.tensor([0.25, 1.0]))
            ref.flatten_grads_with_stats_(grads, sizes, exp, exp_stats)
            for spread in (False, True):
                rows = tk.spread_stats_rows(out.device, sizes) if spread else 0
                stats = self.t(torch.zeros(rows, 2) if spread else torch.tensor([0.25, 1.0]))
                with _configs.forced(flatten=cfg, flatten_spread=cfg):
                    out.fill_(7.0)
                    tk.flatten_grads_with_stats_(grads, sizes, out, stats)
                assert tk.last_backend("flatten_grads_with_stats_") == "triton"
                if out_dtype == torch.bfloat16:
                    assert_bf16_bitwise(out, torch.cat(grads), exp)
                else:  # the upcast is exact: every value, NaN where the source has NaN
                    nan = torch.isnan(exp)
                    assert torch.equal(torch.isnan(out), nan) and torch.equal(out[~nan], exp[~nan]), spread
                total = stats.sum(0) + self.t(torch.tensor([0.25, 1.0])) if spread else stats
                assert total[1].item() == exp_stats[1].item() == 4.0 and torch.isnan(total[0])
        flat = self.t(torch.randn(sum(sizes) + bucket_start, generator=gen))[bucket_start:]
        # parameters that are views at odd offsets of one buffer: destination heads too
        pbuf, params, at = self.t(torch.empty(sum(sizes) + 8 * len(sizes), dtype=torch.bfloat16)), [], 0
        for i, n in enumerate(sizes):
            at += (3 * i + 1) % 8
            params.append(pbuf[at : at + n])
            at += n
        exp_p = [torch.empty_like(p) for p in params]
        with _configs.forced(scatter=cfg, scatter_sr=cfg):
            for sr in (False, True):
                tk.scatter_flat_(flat, params, stochastic_rounding=sr, seed=5, offset=11)
                ref.scatter_flat_(flat, exp_p, stochastic_rounding=sr, seed=5, offset=11)
                for p, e in zip(params, exp_p):
                    assert torch.equal(p.view(torch.int16), e.view(torch.int16)), sr

    # ---- scatter

    # ---- kernel 3: few aligned rows as arguments

    @staticmethod
    def _k3_sizes(cfg: _configs.RowsConfig) -> list[int]:
        """Rows kernel 3 takes: every bucket offset a multiple of 8 elements (16 bytes of bf16); one short row,
        one of two chunks and a part (a program with a masked tile after whole ones), one whole chunk, and an
        odd-length last row."""
        c = cfg.chunk
        return [8, 2 * c + 24, c, 83]

    @pytest.mark.parametrize("cfg", K3_CONFIGS, ids=lambda c: c.tag)
    @pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32, torch.float16])
    def test_flatten_kernel3(self, cfg: _configs.RowsConfig, src_dtype: torch.dtype) -> None:
        """Kernel 3 runs (the launch plan says so): the twin's bits, spread statistics that count NaN and Inf
        and match float64 on finite values, the same bits every call, added to what the rows hold."""
        from hf_superoffload.triton_kernels import _kernels

        sizes = self._k3_sizes(cfg)
        gen = self.gen(41)
        grads = [self.t(torch.randn(n, generator=gen).to(src_dtype)) for n in sizes]
        grads[1][cfg.chunk + 5] = float("nan")
        grads[3][82] = float("-inf")
        out = self.t(torch.empty(sum(sizes), dtype=torch.bfloat16))
        exp_out = torch.empty_like(out)
        exp_stats = self.t(torch.zeros(2))
        ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
        n_rows = tk.spread_stats_rows(out.device, sizes)
        with _configs.forced(flatten_spread=cfg):
            rows = self.t(torch.zeros(n_rows, 2))
            tk.flatten_grads_with_stats_(grads, sizes, out, rows)
            assert _kernels.last_tags("flatten") == (cfg.tag,)
            nan = exp_out.isnan()
            assert torch.equal(out.isnan(), nan)
            assert torch.equal(out[~nan].view(torch.int16), exp_out[~nan].view(torch.int16))
            assert rows[:, 1].sum().item() == 2.0 and int((rows[:, 1] > 0).sum()) == 2  # two programs' rows
            finite = [torch.nan_to_num(g, nan=0.0, neginf=0.0) for g in grads]
            f = torch.cat([g.to(torch.bfloat16) for g in finite]).double()
            first = self.t(torch.zeros(n_rows, 2))
            tk.flatten_grads_with_stats_(finite, sizes, out, first)
            torch.testing.assert_close(first[:, 0].double().sum().cpu(), (f * f).sum().cpu(), rtol=1e-5, atol=0.0)
            assert first[:, 1].sum().item() == 0.0 and int((first[:, 0] != 0).sum()) > 1  # spread, not reduced
            again = self.t(torch.zeros(n_rows, 2))
            tk.flatten_grads_with_stats_(finite, sizes, out, again)
            assert torch.equal(again, first)
            tk.flatten_grads_with_stats_(finite, sizes, out, again)  # adds to every row it writes
            assert torch.equal(again, 2 * first)

    @pytest.mark.parametrize("cfg", [c for c in K3_CONFIGS if c.chunk == 256 or c.warps == 8][:2], ids=lambda c: c.tag)
    def test_kernel3_falls_back(self, cfg: _configs.RowsConfig) -> None:
        """Launches kernel 3 cannot take run the table's next config, with the same results: more rows than
        ``ENTRY_SLOTS``, a row at an odd bucket offset, a missing gradient, statistics reduced in the launch."""
        from hf_superoffload.triton_kernels import _kernels

        base = self._k3_sizes(cfg)
        gen = self.gen(42)
        layouts: list[tuple[list[int], bool, bool]] = [  # (sizes, a None gradient, spread statistics)
            ([8] * _configs.ENTRY_SLOTS + [16], False, True),
            ([5, *base], False, True),
            (base, True, True),
            (base, False, False),
        ]
        for sizes, none, spread in layouts:
            grads: list[torch.Tensor | None] = [self.t(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in sizes]
            if none:
                grads[1] = None
            out = self.t(torch.empty(sum(sizes), dtype=torch.bfloat16))
            exp_out = torch.empty_like(out)
            exp_stats = self.t(torch.zeros(2))
            ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
            stats = self.t(torch.zeros(tk.spread_stats_rows(out.device, sizes), 2) if spread else torch.zeros(2))
            with _configs.forced(flatten=cfg, flatten_spread=cfg):
                tk.flatten_grads_with_stats_(grads, sizes, out, stats)
                ran = _kernels.last_tags("flatten")
            assert ran and cfg.tag not in ran, (sizes, none, spread, ran)
            assert torch.equal(out.view(torch.int16), exp_out.view(torch.int16))
            assert_stats(stats.view(-1, 2).sum(dim=0), exp_stats)
        # the ninth row is what sends the first layout away: eight run kernel 3
        sizes = [8] * _configs.ENTRY_SLOTS
        grads = [self.t(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in sizes]
        out = self.t(torch.empty(sum(sizes), dtype=torch.bfloat16))
        with _configs.forced(flatten_spread=cfg):
            tk.flatten_grads_with_stats_(grads, sizes, out, self.t(torch.zeros(64, 2)))
            assert _kernels.last_tags("flatten") == (cfg.tag,)
        assert torch.equal(out, torch.cat(grads))

    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy fp16 casts (interpreter)
    @pytest.mark.parametrize("cfg", K3_CONFIGS, ids=lambda c: c.tag)
    def test_scatter_kernel3(self, cfg: _configs.RowsConfig) -> None:
        """The cast through kernel 3: fp32 -> bf16 bit for bit as the twin (RNE, ties, NaN, Inf, denormals) and
        with stochastic rounding (the twin's counters); bf16 -> bf16 and fp32 -> fp32 as bit copies."""
        from hf_superoffload.triton_kernels import _kernels

        sizes = self._k3_sizes(cfg)
        gen = self.gen(43)
        flat = self.t(special_f32(sum(sizes), gen))
        params = [self.t(torch.empty(n, dtype=torch.bfloat16)) for n in sizes]
        exp = [torch.empty_like(p) for p in params]
        with _configs.forced(scatter=cfg, scatter_sr=cfg):
            tk.scatter_flat_(flat, params)
            assert _kernels.last_tags("scatter") == (cfg.tag,)
            ref.scatter_flat_(flat, exp)
            for p, e in zip(params, exp):
                assert_bf16_bitwise(p, _slice_of(flat, params, p), e)
            tk.scatter_flat_(flat, params, stochastic_rounding=True, seed=77, offset=1000)
            assert _kernels.last_tags("scatter") == (cfg.tag,)
            ref.scatter_flat_(flat, exp, stochastic_rounding=True, seed=77, offset=1000)
            for p, e in zip(params, exp):
                assert_bf16_bitwise(p, _slice_of(flat, params, p), e)
            flat16 = flat.to(torch.bfloat16)
            tk.scatter_flat_(flat16, params)
            assert _kernels.last_tags("scatter") == (cfg.tag,)
            assert torch.equal(torch.cat(params).view(torch.int16), flat16.view(torch.int16))
            params32 = [self.t(torch.empty(n)) for n in sizes]
            tk.scatter_flat_(flat, params32)
            assert _kernels.last_tags("scatter") == (cfg.tag,)
            assert torch.equal(torch.cat(params32).view(torch.int32), flat.view(torch.int32))

    def test_scatter_bf16_bitwise_vs_torch(self) -> None:
        x = self.t(special_f32(100_000, self.gen(3)))
        assert torch.isinf(x).any() and torch.isnan(x).any()
        p = self.t(torch.empty(100_000, dtype=torch.bfloat16))
        tk.scatter_flat_(x, [p])
        assert tk.last_backend("scatter_flat_") == "triton"
        assert_bf16_bitwise(p, x, x.to(torch.bfloat16))
        # and through flatten (fp32 grads into a bf16 bucket): same rounding
        out = self.t(torch.empty(100_000, dtype=torch.bfloat16))
        tk.flatten_grads_with_stats_([x], [x.numel()], out, None)
        assert_bf16_bitwise(out, x, x.to(torch.bfloat16))

    @pytest.mark.parametrize("n", [1, 127, BIG])
    @pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16])
    def test_scatter_odd_sizes(self, n: int, flat_dtype: torch.dtype) -> None:
        gen = self.gen(n)
        flat = self.t(torch.randn(n + 2 + 3, generator=gen).to(flat_dtype))
        params = [
            self.t(torch.empty(n, dtype=torch.bfloat16)),
            self.t(torch.empty(2, dtype=torch.float32)),
            self.t(torch.empty(3, dtype=torch.float16)),
        ]
        tk.scatter_flat_(flat, params)
        assert tk.last_backend("scatter_flat_") == "triton"
        off = 0
        for p in params:
            assert torch.equal(p, flat[off : off + p.numel()].to(p.dtype)), p.dtype
            off += p.numel()

    def test_scatter_many_small_noncontiguous(self) -> None:
        gen = self.gen(4)
        shapes = random_shapes(50, gen)
        dtypes = [torch.bfloat16, torch.float32, torch.float16]
        params = []
        for i, s in enumerate(shapes):
            p = torch.empty(s, dtype=dtypes[i % 3])
            if i % 6 == 0 and len(s) >= 2:
                p = torch.empty(tuple(reversed(s)), dtype=dtypes[i % 3]).transpose(0, -1)
            params.append(self.t(p))
        total = sum(p.numel() for p in params)
        flat = self.t(torch.randn(total, generator=gen))
        tk.scatter_flat_(flat, params)
        assert tk.last_backend("scatter_flat_") == "triton"
        exp = [torch.empty_like(p) for p in params]
        ref.scatter_flat_(flat, exp)
        for p, e in zip(params, exp):
            assert torch.equal(p, e)
        with pytest.raises(ValueError):
            tk.scatter_flat_(flat[1:], params)

    def test_scatter_bf16_to_bf16_is_a_bit_copy(self) -> None:
        bits = torch.randint(-(2**15), 2**15, (4099,), generator=self.gen(5), dtype=torch.int64)
        bits[:4] = torch.tensor([0x7F81, -0x7F, 0x7FA0, -1])  # signalling / odd-payload NaNs survive a copy
        flat = self.t(bits.to(torch.int16).view(torch.bfloat16))
        p = self.t(torch.empty(4099, dtype=torch.bfloat16))
        tk.scatter_flat_(flat, [p])
        assert tk.last_backend("scatter_flat_") == "triton"
        assert torch.equal(p.view(torch.int16), flat.view(torch.int16))

    def test_stochastic_rounding_neighbours(self) -> None:
        x = self.t(special_f32(60_000, self.gen(6)))
        p = self.t(torch.empty(60_000, dtype=torch.bfloat16))
        tk.scatter_flat_(x, [p], stochastic_rounding=True, seed=1234, offset=7)
        assert tk.last_backend("scatter_flat_") == "triton"
        xb = x.cpu().view(torch.int32).to(torch.int64) & 0xFFFF_FFFF
        got = p.cpu().view(torch.int16).to(torch.int64) & 0xFFFF
        nan = torch.isnan(x.cpu())
        down = xb >> 16  # truncation toward zero
        exact = (xb & 0xFFFF) == 0
        ok = (got == down) | ((got == down + 1) & ~exact)
        assert ok[~nan].all()
        assert torch.isnan(p.float().cpu()[nan]).all()
        inf = torch.isinf(x.cpu())
        assert torch.equal(p.float().cpu()[inf], x.cpu()[inf])
        # both neighbours actually occur, and a different seed gives a different stream
        inexact = ~exact & ~nan & ~inf
        assert (got[inexact] == down[inexact]).any() and (got[inexact] == down[inexact] + 1).any()
        q = torch.empty_like(p)
        tk.scatter_flat_(x, [q], stochastic_rounding=True, seed=1234, offset=7)
        assert torch.equal(q.view(torch.int16), p.view(torch.int16))  # reproducible
        tk.scatter_flat_(x, [q], stochastic_rounding=True, seed=99, offset=7)
        assert not torch.equal(q.view(torch.int16), p.view(torch.int16))

    @pytest.mark.parametrize("value", [1.0 + 2.0**-9 + 2.0**-12, -3.0e-3, 1.0 + 2.0**-16, 7.7e5])
    def test_stochastic_rounding_unbiased(self, value: float) -> None:
        n = 1 << 16
        x = self.t(torch.full((n,), value))
        v = float(x[0])  # the fp32 value actually rounded
        p = self.t(torch.empty(n, dtype=torch.bfloat16))
        tk.scatter_flat_(x, [p], stochastic_rounding=True, seed=42)
        assert tk.last_backend("scatter_flat_") == "triton"
        r = p.double().cpu()
        lo, hi = r.min().item(), r.max().item()
        ulp = hi - lo
        assert ulp > 0 and lo <= v <= hi and set(r.unique().tolist()) == {lo, hi}
        frac = (v - lo) / ulp
        sigma = ulp * (frac * (1 - frac) / n) ** 0.5
        assert abs(r.mean().item() - v) <= 5 * sigma + 1e-12 * abs(v), (r.mean().item(), v, sigma)
        # RNE would be biased here by construction (it always picks the nearer neighbour)
        assert abs(x.to(torch.bfloat16).double().mean().item() - v) > 5 * sigma

    # ---- upcast

    @pytest.mark.parametrize("n", [1, 127, BIG])
    @pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
    def test_upcast(self, n: int, src_dtype: torch.dtype) -> None:
        gen = self.gen(n)
        src = self.t(torch.randn(n, generator=gen).to(src_dtype))
        src[0] = float("inf")
        for scale in (1.0, 0.37, self.t(torch.tensor(1.0 / 3.0))):
            dst = self.t(torch.full((n,), float("nan")))
            tk.upcast_(src, dst, scale)
            assert tk.last_backend("upcast_") == "triton"
            exp = src.float()
            if isinstance(scale, torch.Tensor) or scale != 1.0:
                exp = exp * scale
            assert torch.equal(dst, exp)
            if n == BIG:
                break  # the big size once: interpreter time

    # ---- AdamW

    @pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("weight_decay", [0.0, 0.01])
    @pytest.mark.parametrize("beta1", [0.9, 0.3])
    def test_adamw_vs_torch(self, grad_dtype: torch.dtype, weight_decay: float, beta1: float) -> None:
        gen = self.gen(7)
        n = 4099
        p0 = torch.randn(n, generator=gen)
        param, m, v = self.t(p0.clone()), self.t(torch.zeros(n)), self.t(torch.zeros(n))
        out_bf16 = self.t(torch.empty(n, dtype=torch.bfloat16))
        tp = torch.nn.Parameter(self.t(p0.clone()))
        hyper = AdamWHyper(lr=3e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=weight_decay)
        opt = torch.optim.AdamW([tp], lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                                foreach=False)
        for step in range(1, 6):
            g = self.t(torch.randn(n, generator=gen).to(grad_dtype))
            scale: float | torch.Tensor = 0.75 if step % 2 else self.t(torch.tensor(0.5))
            tp.grad = g.float() * scale
            opt.step()
            tk.adamw_flat_(param, g, m, v, step=step, hyper=hyper, grad_scale=scale, param_bf16_out=out_bf16)
            assert tk.last_backend("adamw_flat_") == "triton"
        st = opt.state[tp]
        torch.testing.assert_close(param, tp.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        assert torch.equal(out_bf16.view(torch.int16), param.to(torch.bfloat16).view(torch.int16))

    def test_adamw_big_odd_vs_twin(self) -> None:
        gen = self.gen(8)
        n = BIG
        state = [self.t(torch.randn(n, generator=gen)), self.t(torch.randn(n, generator=gen).abs() * 1e-2),
                 self.t(torch.rand(n, generator=gen) * 1e-3)]  # fmt: skip
        g = self.t(torch.randn(n, generator=gen).bfloat16())
        twin = [s.clone() for s in state]
        kw = dict(step=3, hyper=AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1))
        tk.adamw_flat_(*state[:1], g, *state[1:], grad_scale=self.t(torch.tensor(0.25)), **kw)
        assert tk.last_backend("adamw_flat_") == "triton"
        ref.adamw_flat_(*twin[:1], g, *twin[1:], grad_scale=self.t(torch.tensor(0.25)), **kw)
        for a, b in zip(state, twin):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    def test_adamw_rejects_bad_args(self) -> None:
        t = self.t(torch.zeros(4))
        hyper = AdamWHyper(lr=1.0, beta1=0.9, beta2=0.9, eps=1e-8, weight_decay=0.0)
        with pytest.raises(ValueError):
            tk.adamw_flat_(t, t, t, t, step=0, hyper=hyper)
        with pytest.raises(ValueError):
            tk.adamw_flat_(t.double(), t, t, t, step=1, hyper=hyper)
        with pytest.raises(ValueError, match="hyper must be an AdamWHyper"):
            tk.adamw_flat_(t, t, t, t, step=1, hyper=(1.0, 0.9, 0.9, 1e-8, 0.0))  # type: ignore[arg-type]


@pytest.mark.skipif(not _INTERPRETER, reason="a GPU is present: Triton compiles natively here (see TestCuda)")
class TestInterpreter(_KernelChecks):
    """The kernels on CPU tensors through ``TRITON_INTERPRET=1`` (what CI runs)."""

    device = "cpu"

    @pytest.fixture(autouse=True)
    def _require_interpreter(self) -> None:
        assert _STATUS["mode"] == "interpreter", f"Triton is not in interpreter mode here: {_STATUS}"


def test_interpreted_launches_from_two_threads() -> None:
    """The engine launches from its CPU worker and the training thread at once; Triton's interpreter is not
    thread-safe, so the dispatcher serialises interpreted launches (without it this raised InterpreterError)."""
    import threading

    if not _INTERPRETER:
        pytest.skip("interpreter mode only")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            for _ in range(6):
                params = [torch.empty(n, dtype=torch.bfloat16) for n in (37, 129, 1000)]
                flat = torch.randn(sum(p.numel() for p in params), generator=g)
                tk.scatter_flat_(flat, params)
                expect = torch.split(flat.to(torch.bfloat16), [p.numel() for p in params])
                assert all(torch.equal(p, e) for p, e in zip(params, expect, strict=True))
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert tk.last_backend("scatter_flat_") == "triton"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestCuda(_KernelChecks):
    """The same checks with the natively compiled kernels."""

    device = "cuda"

    @pytest.fixture(autouse=True)
    def _require_native(self) -> None:
        if _STATUS["mode"] != "native":
            pytest.skip(f"Triton is not compiling natively in this process: {_STATUS}")

    def test_no_host_sync(self) -> None:
        """No op synchronises with the host once warm (tables cached, grad_scale/scale as device tensors)."""
        n = 10_000
        grads = [self.t(torch.randn(n)), None, self.t(torch.randn(7).bfloat16())]
        out = self.t(torch.empty(n + 3 + 7, dtype=torch.bfloat16))
        stats = self.t(torch.zeros(2))
        params = [self.t(torch.empty(n, dtype=torch.bfloat16)), self.t(torch.empty(10))]
        flat = self.t(torch.randn(n + 10))
        p, m, v = self.t(torch.randn(n)), self.t(torch.zeros(n)), self.t(torch.zeros(n))
        scale = self.t(torch.tensor(0.5))
        hyper = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)

        def run() -> None:
            tk.flatten_grads_with_stats_(grads, [n, 3, 7], out, stats)
            tk.scatter_flat_(flat, params, stochastic_rounding=True, seed=3)
            tk.upcast_(out[:n], m, scale)
            tk.adamw_flat_(p, out[:n], m, v, step=1, hyper=hyper, grad_scale=scale)

        run()  # warm: compile, self-test, tables
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ dispatch, twins


def test_disable_env_forces_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_SUPEROFFLOAD_DISABLE_TRITON", "1")
    x = torch.randn(10)
    p = torch.empty(10, dtype=torch.bfloat16)
    tk.scatter_flat_(x, [p])
    assert tk.last_backend("scatter_flat_") == "reference"
    assert torch.equal(p, x.bfloat16())
    assert tk.backend_for(x) == "reference"


def test_cpu_without_interpret_env_uses_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = torch.empty(4)
    stats = torch.zeros(2)
    tk.flatten_grads_with_stats_([torch.ones(4)], [4], out, stats)
    assert tk.last_backend("flatten_grads_with_stats_") == "reference"
    assert stats.tolist() == [4.0, 0.0]


def test_interpreter_walks_triton_language_once_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter walks ``triton.language`` (``inspect.getmembers``) on every ``@triton.jit`` helper
    call; ``_interpreter`` leaves one walk per launch (and per module not yet patched in it): the same bits,
    a fraction of the walks (without it, half of CI's interpreter time)."""
    if not _INTERPRETER:
        pytest.skip("interpreter mode only")
    from hf_superoffload.triton_kernels import _interpreter
    from triton.runtime import interpreter as ip

    applied = _interpreter.skip_repeated_lang_patches()
    assert applied, "this Triton's interpreter changed its patching API: _interpreter.py no longer applies (CI slower)"
    assert _interpreter.skip_repeated_lang_patches()  # idempotent
    wrapped = ip._patch_lang
    assert not hasattr(wrapped.__wrapped__, "__wrapped__")  # wrapped once, around Triton's own
    walks = 0
    real_getmembers = inspect.getmembers

    def counting(obj: object, *args: object) -> list:
        nonlocal walks
        walks += 1
        return real_getmembers(obj, *args)

    monkeypatch.setattr(inspect, "getmembers", counting)
    cfg = _configs.RowsConfig(0, 256, 2, 8, kernel=2, packed=True)  # many tiles and rows: many helper calls
    gen = torch.Generator().manual_seed(5)
    sizes = [int(x) for x in torch.randint(1, 600, (24,), generator=gen)]
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32) for i, n in enumerate(sizes)]
    exp_out, exp_stats = torch.empty(sum(sizes), dtype=torch.bfloat16), torch.zeros(2)
    ref.flatten_grads_with_stats_(grads, sizes, exp_out, exp_stats)
    counts = {}
    for name, patch in (("skipping", wrapped), ("triton's own", wrapped.__wrapped__)):
        monkeypatch.setattr(ip, "_patch_lang", patch)
        out, stats = torch.empty_like(exp_out), torch.zeros(2)
        walks = 0
        with _configs.forced(flatten=cfg):
            tk.flatten_grads_with_stats_(grads, sizes, out, stats)
        assert tk.last_backend("flatten_grads_with_stats_") == "triton"
        assert torch.equal(out.view(torch.int16), exp_out.view(torch.int16)), name
        assert_stats(stats, exp_stats)
        counts[name] = walks
    # a few launches (one per dtype group, the statistics' reduction), ~7 walks each; thousands without
    assert counts["skipping"] < 100 and counts["triton's own"] > 20 * counts["skipping"], counts


@pytest.mark.skipif(not _INTERPRETER, reason="CPU tensors use the twins when Triton compiles natively")
def test_unsupported_dtype_falls_back() -> None:
    g = torch.randn(5, dtype=torch.float64)
    out = torch.empty(5)
    stats = torch.zeros(2)
    tk.flatten_grads_with_stats_([g], [5], out, stats)
    assert tk.last_backend("flatten_grads_with_stats_") == "reference"
    assert torch.equal(out, g.float())
    assert tk.backend_for(torch.zeros(1), torch.zeros(1, device="meta")) == "reference"


def test_status_reports_mode() -> None:
    st = tk.triton_status()
    assert st["importable"] and st["mode"] == ("interpreter" if _INTERPRETER else "native")
    assert all(err is None for err in st["smoke"].values()), st


def test_twin_stochastic_rounding() -> None:
    x = torch.full((1 << 16,), 1.0 + 2.0**-9 + 2.0**-12)
    r = ref.stochastic_round_to_bf16(x, seed=5).double()
    v = float(x[0])
    lo, hi = r.min().item(), r.max().item()
    assert lo < v < hi and len(r.unique()) == 2
    frac = (v - lo) / (hi - lo)
    sigma = (hi - lo) * (frac * (1 - frac) / x.numel()) ** 0.5
    assert abs(r.mean().item() - v) <= 5 * sigma
    s = special_f32(6000, torch.Generator().manual_seed(9))
    got = ref.stochastic_round_to_bf16(s).view(torch.int16).to(torch.int64) & 0xFFFF
    down = (s.view(torch.int32).to(torch.int64) & 0xFFFF_FFFF) >> 16
    nan = torch.isnan(s)
    assert ((got == down) | (got == down + 1))[~nan].all()


def test_twin_adamw_matches_torch() -> None:
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(300, generator=gen)
    p, m, v = p0.clone(), torch.zeros(300), torch.zeros(300)
    tp = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([tp], lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05, foreach=False)
    for step in range(1, 4):
        g = torch.randn(300, generator=gen)
        tp.grad = g * 0.5
        opt.step()
        ref.adamw_flat_(p, g, m, v, step=step, hyper=AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6,
                                                                weight_decay=0.05), grad_scale=torch.tensor(0.5))
    assert torch.equal(p, tp.detach())


@pytest.mark.parametrize("n", [1, 4095, 4097, 100_003, 1_000_003])
def test_twin_statistics_do_not_depend_on_torch_threads(n: int) -> None:
    """The twin's sum of squares (the CPU engine's gradient norm) gives the same bits for 1, 2 and 3 torch threads,
    past the parallel grain too, and agrees with an fp64 sum to fp32 rounding; the count finds every non-finite
    value. A plain ``torch.sum`` split by the thread count ([Note: determinism]). The readers' ``[rows, 2]``
    column sums rely on torch splitting such a sum by column, never within one: checked here too."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8).to(torch.bfloat16)
    rows = torch.rand(3, 40_000 + n % 7, 2, generator=gen)  # past the grain
    prev = torch.get_num_threads()
    seen = set()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            stats = torch.zeros(5, 2)
            ref.flatten_grads_with_stats_([x[: n // 2].float(), x[n // 2 :].float()], [n // 2, n - n // 2],
                                          torch.empty(n, dtype=torch.bfloat16), stats)
            seen.add((stats.view(torch.int32).numpy().tobytes(),
                      rows.view(-1, 2).sum(dim=0).view(torch.int32).numpy().tobytes()))
    finally:
        torch.set_num_threads(prev)
    assert len(seen) == 1, "the bits followed the torch thread count"
    torch.testing.assert_close(stats[0, 0].double(), (x.double() ** 2).sum(), rtol=1e-6, atol=0.0)
    assert stats[0, 1].item() == 0.0 and stats[1:].abs().sum().item() == 0.0  # the twin adds into row 0
    bad = x.clone()
    bad[n // 3 :: 50_000] = float("inf")
    bad[n // 2] = float("nan")
    got = ref.sumsq_nonfinite(bad)
    assert torch.isnan(got[0]) and got[1].item() == (~torch.isfinite(bad)).sum().item()


def test_kernel2_heads_and_scalar_rows() -> None:
    """Kernel 2's per-program records: row range and first row; empty programs get zeros."""
    from hf_superoffload.triton_kernels import _kernels

    rows = np.arange(12, dtype=np.int64).reshape(3, 4) + 100
    starts = np.asarray([0, 2, 2, 3], dtype=np.int32)
    heads = _kernels._heads(rows, starts)
    assert heads.shape == (3, 8) and heads.dtype == np.int64
    assert heads[0].tolist() == [0, 2, *rows[0].tolist(), 0, 0]
    assert heads[1].tolist() == [2, 2, 0, 0, 0, 0, 0, 0]
    assert heads[2].tolist() == [2, 3, *rows[2].tolist(), 0, 0]
    # element tiles [S, R] hold 8 elements per thread (R = block / 8 into 16-bit, block / 4 into fp32)
    for block, warps, dst_kind, s in [(1024, 4, 1, 8), (4096, 4, 1, 2), (4096, 4, 0, 1), (256, 1, 1, 8),
                                      (8192, 8, 1, 2), (65536, 4, 1, 1)]:  # fmt: skip
        cfg = _configs.RowsConfig(0, block, warps, 8, kernel=2)
        assert _kernels._scalar_rows(cfg, dst_kind) == s, (block, warps, dst_kind)


@pytest.mark.parametrize(
    "bad", [torch.zeros(3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.float64), torch.zeros(2, 2, 2)]
)
def test_flatten_rejects_bad_stats_before_writing(bad: torch.Tensor) -> None:
    """A statistics buffer that is neither ``[2]`` nor ``[rows, 2]`` float32 is a ValueError naming what to
    allocate, raised before the bucket is touched."""
    out = torch.full((5,), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"spread_stats_rows"):
        tk.flatten_grads_with_stats_([torch.ones(5)], [5], out, bad)
    assert torch.equal(out, torch.full((5,), 3.0, dtype=torch.bfloat16))


def test_flatten_strided_spread_stats_take_the_twin() -> None:
    """Non-contiguous ``[rows, 2]`` statistics go to the twin, which adds into the first row."""
    g = torch.randn(100).to(torch.bfloat16)
    out = torch.empty(100, dtype=torch.bfloat16)
    stats = torch.zeros(2, 7).T  # [7, 2], strided
    stats[3, 0] = 1.5  # what a row held before: kept
    tk.flatten_grads_with_stats_([g], [100], out, stats)
    assert tk.last_backend("flatten_grads_with_stats_") == "reference"
    f = g.double()
    torch.testing.assert_close(stats[:, 0].double().sum(), (f * f).sum() + 1.5, rtol=1e-5, atol=0.0)
    assert stats[:, 1].sum().item() == 0.0


@pytest.mark.parametrize("kernel", [1, 2, 3])
def test_pdl_only_where_a_dependent_launch_exists(kernel: int) -> None:
    """The PDL constexpr (and with it the launch option) holds only compiled on an sm_90+ CUDA device: never
    under the interpreter or on the CPU, whatever the config asks; and never where the config does not ask."""
    from hf_superoffload.triton_kernels import _kernels

    RowsConfig = _configs.RowsConfig
    chunk, ppsm = (2048, 0) if kernel == 3 else (0, 8)
    cfg = RowsConfig(chunk, 2048, 4, ppsm, kernel=kernel, packed=kernel > 1, pdl=True)
    plain = dataclasses.replace(cfg, pdl=False)
    assert _kernels._meta(cfg, 1, 1, True, False, True)["PDL"] is False  # no device: the offline compile
    assert _kernels._meta(cfg, 1, 1, True, False, True, torch.device("cpu"))["PDL"] is False
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        expect = _kernels.mode() == "native" and torch.cuda.get_device_capability(dev) >= (9, 0)
        assert _kernels._meta(cfg, 1, 1, True, False, True, dev)["PDL"] is expect
        assert _kernels._meta(plain, 1, 1, True, False, True, dev)["PDL"] is False
