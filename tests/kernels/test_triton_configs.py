"""The launch-config policy of the multi-tensor kernels and the stochastic-rounding hash twin (no Triton)."""

from __future__ import annotations

import pytest
import torch
from hf_superoffload.triton_kernels import _configs
from hf_superoffload.triton_kernels import reference as ref
from hf_superoffload.triton_kernels._configs import HEURISTIC, LEGACY, RowsConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(chunk=0, block=1000, warps=4, programs_per_sm=8), "block"),
        (dict(chunk=4096, block=8, warps=4, programs_per_sm=0), "block"),
        (dict(chunk=3000, block=1024, warps=4, programs_per_sm=0), "chunk"),
        (dict(chunk=512, block=1024, warps=4, programs_per_sm=0), "chunk"),
        (dict(chunk=4096, block=1024, warps=4, programs_per_sm=8), "chunk"),
        (dict(chunk=0, block=1024, warps=3, programs_per_sm=8), "warps"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=-1), "programs_per_sm"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, kernel=4), "kernel"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, kernel=3), "programs_per_sm"),
        (dict(chunk=16384, block=1024, warps=4, programs_per_sm=0, kernel=3), "chunk"),
        (dict(chunk=4096, block=1024, warps=4, programs_per_sm=0, kernel=3, realign=True), "realign"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, packed=True), "packed"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, epilogue="fast"), "epilogue"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, epilogue="tree"), "epilogue"),  # removed
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, min_per_program=100), "min_per_program"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, interleave=-8), "interleave"),
        (dict(chunk=4096, block=1024, warps=4, programs_per_sm=0, interleave=8192), "interleave"),
        (dict(chunk=4096, block=1024, warps=4, programs_per_sm=0, min_per_program=8192), "min_per_program"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, kernel=2, realign=True), "realign"),
        (dict(chunk=0, block=1024, warps=4, programs_per_sm=8, kernel=2, lookahead=True), "lookahead"),
    ],
)
def test_rows_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"RowsConfig\.{field}="):
        RowsConfig(**kwargs)


def test_heuristic_tables_are_well_formed() -> None:
    for fam in _configs.FAMILIES:
        rows = HEURISTIC[fam]
        assert rows[-1][0] is None, fam
        bounds = [b for b, _ in rows[:-1]]
        assert bounds == sorted(bounds) and all(isinstance(b, int) and b > 0 for b in bounds)


def test_choose_follows_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = RowsConfig(0, 1024, 4, 8), RowsConfig(16384, 2048, 4, 0)
    monkeypatch.setitem(HEURISTIC, "flatten", ((1000, a), (None, b)))
    assert _configs.choose("flatten", 1) == a
    assert _configs.choose("flatten", 1000) == a
    assert _configs.choose("flatten", 1001) == b
    assert _configs.choose("flatten", 1 << 40) == b


def test_forced_overrides_and_restores() -> None:
    a = RowsConfig(0, 1024, 4, 3)
    b = RowsConfig(8192, 2048, 8, 0, one_pass=False)
    table = _configs.choose("scatter", 10)
    with _configs.forced(scatter=a):
        assert _configs.choose("scatter", 10) == a and _configs.is_forced("scatter")
        assert not _configs.is_forced("flatten")
        with _configs.forced(scatter=b, flatten=b):
            assert _configs.choose("scatter", 10) == b and _configs.choose("flatten", 10) == b
        assert _configs.choose("scatter", 10) == a and not _configs.is_forced("flatten")
        with _configs.forced(scatter=None):
            assert _configs.choose("scatter", 10) == table
    assert _configs.choose("scatter", 10) == table and not _configs.is_forced("scatter")
    with pytest.raises(ValueError, match="unknown op family"), _configs.forced(upcast=a):
        pass


@pytest.mark.parametrize(
    ("warps", "regs", "shared", "expected"),
    [
        (4, 32, 0, 16),  # thread-limited: 2048 / 128
        (4, 64, 0, 8),  # 64 regs x 128 threads = 8 Ki per program
        (4, 72, 0, 7),  # 72 * 32 = 2304 per warp: 28 warps of registers
        (8, 128, 0, 2),
        (1, 16, 0, 32),  # block-limited
        (4, 32, 64 * 1024, 3),  # shared-memory-limited (228 KiB per SM)
    ],
)
def test_max_resident_programs(warps: int, regs: int, shared: int, expected: int) -> None:
    assert _configs.max_resident_programs(warps=warps, regs_per_thread=regs, shared_bytes=shared) == expected


def test_sweep_candidates() -> None:
    for fam in _configs.FAMILIES:
        cands = _configs.sweep_candidates(fam)
        assert cands[0] == LEGACY
        assert len(cands) == len(set(cands)) and len(cands) <= 20  # the sweep's time: docs/triton_kernels.md
        assert len({c.tag for c in cands}) == len(cands)  # the sweep's records are keyed by tag
        assert all(c in cands for _, c in HEURISTIC[fam])
    flatten = _configs.sweep_candidates("flatten")
    assert any(not c.one_pass and c.programs_per_sm for c in flatten)
    assert any(c.kernel == 2 and c.packed for c in flatten) and any(c.kernel == 2 and not c.packed for c in flatten)
    # issue #4's fixed-cost variants still in the sweep (kernel 1's interleave left it: it lost at every size in
    # the 2026-11-30 sweep), and the per-byte ones on kernel 2
    for k in (1, 2):
        mine = [c for c in flatten if c.kernel == k]
        assert any(c.epilogue == "wide" for c in mine) and any(c.stream for c in mine)
    assert any(c.interleave for c in flatten if c.kernel == 2)
    assert any(c.min_per_program for c in flatten) and any(c.block == 8192 for c in flatten)
    assert any(c.realign and not c.lookahead for c in flatten) and any(c.lookahead and not c.realign for c in flatten)
    assert all(c in flatten for _, c in HEURISTIC["flatten"])


def test_one_per_path_keeps_every_branch_and_the_smallest_tiles() -> None:
    """The interpreter's tests and rehearsal run one config per code path: every constexpr branch of every
    family's candidates stays represented, by its smallest tiles, and nothing is invented."""
    RowsConfig = _configs.RowsConfig
    small, big = RowsConfig(2048, 2048, 4, 0, kernel=3, packed=True), RowsConfig(4096, 4096, 8, 0, kernel=3, packed=True)
    assert _configs.one_per_path([big, small]) == [small]
    assert _configs.one_per_path([big, RowsConfig(4096, 4096, 8, 0, kernel=3, packed=True, pdl=True)]) == [
        big, RowsConfig(4096, 4096, 8, 0, kernel=3, packed=True, pdl=True)]  # fmt: skip
    branches = ("kernel", "packed", "one_pass", "realign", "lookahead", "pdl", "stream", "epilogue")
    for fam in _configs.FAMILIES:
        cands = _configs.sweep_candidates(fam)
        kept = _configs.one_per_path(cands)
        assert set(kept) <= set(cands) and len(kept) == len(set(kept)) < len(cands) + 1
        for f in branches:
            assert {getattr(c, f) for c in kept} == {getattr(c, f) for c in cands}, (fam, f)
        for f in ("programs_per_sm", "interleave", "min_per_program"):
            assert {bool(getattr(c, f)) for c in kept} == {bool(getattr(c, f)) for c in cands}, (fam, f)


def test_kernel3_is_chosen_only_where_usable() -> None:
    """Kernel 3 runs only launches of few aligned rows, without statistics or with spread ones; a table row or a
    forced config of kernel 3 is passed over for any other launch (the next matching row of the table)."""
    k3 = RowsConfig(4096, 4096, 8, 0, kernel=3, packed=True)
    assert k3.tag == "c4096/b4096/w8/1p/k3w"
    assert _configs.usable(k3, few_aligned=True, stats=False, spread=False)
    assert _configs.usable(k3, few_aligned=True, stats=True, spread=True)
    assert not _configs.usable(k3, few_aligned=True, stats=True, spread=False)
    assert not _configs.usable(k3, few_aligned=False, stats=False, spread=False)
    rows = RowsConfig(0, 2048, 4, 8)
    assert _configs.usable(rows, few_aligned=False, stats=True, spread=False)
    for fam in _configs.FAMILIES:
        for n in (1, 2**24, 2**30):
            table = _configs.choose(fam, n, kernel3=False)
            assert table.kernel != 3
            with _configs.forced(**{fam: k3}):
                assert _configs.choose(fam, n) == k3
                assert _configs.choose(fam, n, kernel3=False) == table  # the table's own row, not the forced one
            with _configs.forced(**{fam: rows}):
                assert _configs.choose(fam, n, kernel3=False) == rows


def test_tags_name_kernel_2() -> None:
    assert RowsConfig(0, 2048, 4, 8).tag == "p8/b2048/w4/1p"
    assert RowsConfig(0, 4096, 4, 8, kernel=2).tag == "p8/b4096/w4/1p/k2"
    assert RowsConfig(0, 4096, 4, 8, one_pass=False, kernel=2, packed=True).tag == "p8/b4096/w4/2p/k2w"
    wide = RowsConfig(0, 2048, 4, 8, kernel=2, packed=True, epilogue="wide", stream=True, min_per_program=16384,
                      interleave=8192)  # fmt: skip
    assert wide.tag == "p8/b2048/w4/1p/k2w/ew/s/m16k/i8k"
    assert RowsConfig(4096, 1024, 4, 0, stream=True).tag == "c4096/b1024/w4/1p/s"
    assert RowsConfig(0, 1024, 4, 8, interleave=1000).tag == "p8/b1024/w4/1p/i1000"
    assert RowsConfig(0, 2048, 4, 8, kernel=2, packed=True, realign=True, lookahead=True).tag == "p8/b2048/w4/1p/k2w/ra/la"
    assert RowsConfig(2048, 2048, 4, 0, kernel=3, packed=True, stream=True, pdl=True).tag == "c2048/b2048/w4/1p/k3w/s/pdl"


# ------------------------------------------------------------------------------- the hash twin


def _fmix32_py(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 5, -3])
def test_noise16_matches_plain_python(seed: int) -> None:
    k0, k1 = ref.sr_keys(seed)
    assert 0 <= k0 < 2**31 and 0 <= k1 < 2**31
    counters = [0, 1, 2, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 12345, -1, -(2**33)]
    got = ref.noise16(torch.tensor(counters, dtype=torch.int64), seed).tolist()
    for c, g in zip(counters, got):
        lo, hi = c & 0xFFFFFFFF, (c >> 32) & 0xFFFFFFFF
        assert g == _fmix32_py(_fmix32_py(lo ^ k0) ^ hi ^ k1) >> 16, c


def test_noise16_is_uniform_and_seeded() -> None:
    c = torch.arange(1 << 18, dtype=torch.int64)
    a = ref.noise16(c, 5)
    assert int(a.min()) >= 0 and int(a.max()) < 1 << 16
    hist = torch.bincount(a >> 12, minlength=16).double()  # 16 bins of 2**14 expected counts
    assert ((hist - hist.mean()).abs() / hist.mean()).max() < 0.03
    assert (ref.noise16(c, 6) != a).float().mean() > 0.99
    assert torch.equal(ref.noise16(c + 7, 5)[:-7], a[7:])  # keyed by the counter alone


# ----------------------------------------------------------------------------- balanced rows


@pytest.mark.parametrize("trial", range(6))
def test_balanced_rows_cover_align_and_balance(trial: int) -> None:
    import numpy as np
    from hf_superoffload.triton_kernels._tables import balanced_rows

    rng = np.random.default_rng(trial)
    for _ in range(50):
        k = int(rng.integers(1, 12))
        numel = rng.integers(0, 5000, k)
        if rng.random() < 0.4:
            numel[int(rng.integers(0, k))] = int(rng.integers(0, 200_000))
        parts = int(rng.integers(1, 40))
        src = rng.integers(0, 10**6, k) * 8 + rng.integers(0, 8, k)
        dst = np.cumsum(numel) - numel + 3
        flags = rng.integers(0, 8, k)
        rows, starts = balanced_rows(src, dst, numel, flags, parts)
        assert len(starts) == parts + 1 and starts[0] == 0 and starts[-1] == len(rows)
        assert (np.diff(starts) >= 0).all() and (rows[:, 3] > 0).all()
        for e in range(k):  # each entry covered exactly once, in order, cut at entry-relative multiples of 8
            if numel[e] == 0:
                continue
            r = rows[rows[:, 1] - rows[:, 0] == dst[e] - src[e]]
            r = r[(r[:, 0] >= src[e]) & (r[:, 0] < src[e] + numel[e])]
            assert r[0, 0] == src[e] and r[-1, 0] + r[-1, 3] == src[e] + numel[e]
            assert (r[1:, 0] == r[:-1, 0] + r[:-1, 3]).all() and ((r[:, 0] - src[e]) % 8 == 0).all()
            assert (r[:, 2] == flags[e]).all()
        share = -(-int(numel.sum()) // parts)
        share = -(-share // 8) * 8
        per = [int(rows[starts[p] : starts[p + 1], 3].sum()) for p in range(parts)]
        assert sum(per) == numel.sum() and max(per) <= share + 7, (per, share)


@pytest.mark.parametrize("trial", range(4))
def test_interleaved_rows_deal_pieces_round_robin(trial: int) -> None:
    """The rows of ``parts * pieces`` balanced pieces, program ``p`` owning pieces ``p, p + parts, ...`` in that
    order: the same rows as balanced_rows, reordered; shares balanced as before."""
    import numpy as np
    from hf_superoffload.triton_kernels._tables import balanced_rows, interleaved_rows

    rng = np.random.default_rng(100 + trial)
    for _ in range(30):
        k = int(rng.integers(1, 10))
        numel = rng.integers(0, 3000, k)
        numel[int(rng.integers(0, k))] = int(rng.integers(0, 100_000))
        parts, pieces = int(rng.integers(1, 20)), int(rng.integers(1, 6))
        src = rng.integers(0, 10**6, k) * 8
        dst = np.cumsum(numel) - numel + 5
        flags = rng.integers(0, 8, k)
        rows, starts = interleaved_rows(src, dst, numel, flags, parts, pieces)
        ref_rows, ref_starts = balanced_rows(src, dst, numel, flags, parts * pieces)
        assert len(starts) == parts + 1 and starts[0] == 0 and starts[-1] == len(rows) == len(ref_rows)
        want = []
        for p in range(parts):
            mine = np.concatenate(
                [ref_rows[ref_starts[q] : ref_starts[q + 1]] for q in range(p, parts * pieces, parts)]
            )
            assert np.array_equal(rows[starts[p] : starts[p + 1]], mine), (p, parts, pieces)
            want.append(int(mine[:, 3].sum()) if len(mine) else 0)
        assert sum(want) == numel.sum()
        if numel.sum() >= 8 * parts * pieces:
            share = -(-int(numel.sum()) // (parts * pieces))
            assert max(want) <= pieces * (-(-share // 8) * 8 + 7)
    # pieces == 1 is balanced_rows itself
    numel = np.asarray([100, 3, 5000])
    a = interleaved_rows(np.zeros(3), np.cumsum(numel) - numel, numel, np.zeros(3), 7, 1)
    b = balanced_rows(np.zeros(3), np.cumsum(numel) - numel, numel, np.zeros(3), 7)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])

