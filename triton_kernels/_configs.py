"""Launch configurations of the multi-tensor copy kernels (flatten, scatter): data, chosen from the sizes.

Pure Python (no Triton, no torch): the policy is a table, the launchers in :mod:`._kernels` execute it.

A :class:`RowsConfig` says how wide one tile is (``block`` elements on ``warps`` warps), how many programs
run and how the bucket is cut into work-table rows:

* ``programs_per_sm > 0``: a persistent grid of that many programs per SM (clamped to what fits on an SM
  at once, and to one tile's worth of elements per program), and each program gets one *equal contiguous
  share* of the group's elements (``_tables.balanced_rows``): no program has a row more than another, so
  there is no half-empty last wave whatever the bucket size; ``chunk`` must be 0.
* ``programs_per_sm == 0``: rows of ``chunk`` elements, one program per row (the original scheme).

``one_pass``: the last program to finish adds the per-program statistics partials into ``stats`` in the
same launch; else a second, single-program launch does.

``kernel``: 1 is ``_rows_kernel`` (1-D tiles, one accumulator slot per tile element); 2 is ``_rows2_kernel``
(2-D tiles of whole 16-byte vectors, statistics folded within the thread into one slot per vector, so a
wide tile keeps more bytes in flight without costing registers; vector-granular tails; one layout on
misaligned rows), and ``packed`` makes kernel 2 move bf16 -> bf16 aligned rows as int32 words with the
statistics on the packed bits. 3 is ``_entries_kernel``: no work table, the rows themselves are kernel
arguments (one program per ``chunk`` elements of a row); it runs only a launch of at most ``ENTRY_SLOTS``
rows, every one 16-byte aligned on both sides and with a source, without statistics or with spread ones
(:func:`usable`). Where it cannot, :func:`choose` goes on down the table. docs/triton_kernels.md has the
reasoning.

Aimed at the fixed costs and the memory system (issue #4's last item; docs/triton_kernels.md, "Fixed costs"):

* ``epilogue``: how the last-ticket program adds the partials (ONE_PASS): ``"loop"`` in chunks as wide as
  the tile's accumulator (5 serial L2 round trips for ~1000 partials at kernel 2's b2048); ``"wide"`` in
  chunks of up to 128 per warp (512 on 4 warps: 3 round trips; wider chunks cost the kernel registers)
  with ``stats`` loaded first. Every order is fixed: deterministic. (A two-level ``"tree"`` lost to both at
  every size in the 2026-11-30 sweep and was removed on 2026-12-01, 6e032bd.)
* ``stream``: cache hints on the streaming tile loads / stores (``evict_first`` loads, ``.cs`` stores):
  the data is touched once, so it should not displace what stays in L2.
* ``min_per_program``: a persistent grid gets at most ``ceil(elements / min_per_program)`` programs (0: a
  tile each), so a small bucket runs fewer, longer programs: fewer partials, atomics and start-ups.
* ``realign`` (kernel 2, packed): bf16 -> bf16 rows that are not 16-byte aligned on both sides (an entry
  at an odd bucket offset) move whole 16-byte vectors too: aligned on the destination, each built from two
  aligned source vectors shifted by the row's phase difference, instead of element by element (8 2-byte
  loads and 8 2-byte stores per 16 bytes). docs/triton_kernels.md, "Per-byte costs in the SASS". Rows with
  an fp32 side (an fp32 gradient into a bf16 bucket, the scatter's fp32 bucket at an odd offset) move whole
  tiles aligned on the destination (16-byte stores) with the source read element by element (2026-12-01, 66a1e5b).
* ``lookahead`` (kernel 2, packed): the word tiles' loads run one whole tile ahead of their stores and
  statistics (the statistics loop is not unrolled, so without it a warp issues its next loads only after
  the current tile's ~85 store / statistics instructions; docs/triton_kernels.md, "Per-byte costs in the
  SASS"). 8 more registers per thread at b2048.
* ``pdl``: launched as a programmatic dependent launch (sm_90+, compiled Triton; elsewhere a plain
  launch): the launch's programs are scheduled while the previous grid in the stream drains and wait for it
  to complete before any memory access, so back-to-back launches lose less to the gap between grids
  (docs/triton_kernels.md, "Dependent launch").
* ``interleave``: on a persistent grid, each program's share is cut into pieces of about this many
  elements, dealt round-robin over the programs (piece ``i`` to program ``i % grid``), so at any moment the
  grid streams through one region of memory instead of ``grid`` distant ones (0: one contiguous share).

:func:`choose` picks a config from a table keyed by the bucket's element count (the first row whose bound
is at least the count): deterministic, no run-time autotuning, so nothing is compiled or timed inside a
CUDA-graph capture or under ``TRITON_INTERPRET=1``. :func:`forced` overrides the choice for one op family
(the benchmark sweep and the tests use it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "ENTRY_SLOTS",
    "EPILOGUES",
    "FAMILIES",
    "HEURISTIC",
    "LEGACY",
    "RowsConfig",
    "choose",
    "forced",
    "is_forced",
    "max_resident_programs",
    "one_per_path",
    "sweep_candidates",
    "usable",
]

# Op families with their own table: flatten (with or without statistics reduced in the launch), flatten with
# spread statistics (one ``stats`` row per program: no reduction, so many short programs cost nothing extra),
# the plain scatter (RNE cast or bit copy) and the stochastic-rounding scatter (ALU-heavier: a hash per
# element).
FAMILIES = ("flatten", "flatten_spread", "scatter", "scatter_sr")
# RowsConfig.epilogue values
EPILOGUES = ("loop", "wide")


@dataclass(frozen=True)
class RowsConfig:
    """One launch configuration of the row kernel (see the module docstring)."""

    chunk: int
    block: int
    warps: int
    programs_per_sm: int
    one_pass: bool = True
    kernel: int = 1
    packed: bool = False
    epilogue: str = "loop"
    stream: bool = False
    min_per_program: int = 0
    interleave: int = 0
    realign: bool = False
    lookahead: bool = False
    pdl: bool = False

    def __post_init__(self) -> None:
        def bad(field: str, value: object, fix: str) -> ValueError:
            return ValueError(f"RowsConfig.{field}={value!r} is invalid: {fix}")

        if self.block < 16 or self.block & (self.block - 1):
            raise bad("block", self.block, "use a power of two >= 16 (e.g. 1024)")
        if self.warps not in (1, 2, 4, 8, 16):
            raise bad("warps", self.warps, "use 1, 2, 4, 8 or 16")
        if self.programs_per_sm < 0:
            raise bad(
                "programs_per_sm", self.programs_per_sm, "use 0 (one program per row) or a positive count"
            )
        if self.programs_per_sm and self.chunk:
            raise bad(
                "chunk", self.chunk, "use 0 with a persistent grid (programs_per_sm > 0): rows are balanced"
            )
        if not self.programs_per_sm and (self.chunk < self.block or self.chunk % self.block):
            raise bad("chunk", self.chunk, f"use a multiple of block={self.block} (e.g. {4 * self.block})")
        if self.kernel not in (1, 2, 3):
            raise bad("kernel", self.kernel, "use 1 (_rows_kernel), 2 (_rows2_kernel) or 3 (_entries_kernel)")
        if self.kernel == 3 and self.programs_per_sm:
            raise bad("programs_per_sm", self.programs_per_sm, "use 0 with kernel=3 (one program per chunk)")
        if self.kernel == 3 and self.chunk > 8 * self.block:
            raise bad("chunk", self.chunk, f"use at most 8 tiles per program with kernel=3 (<= {8 * self.block})")
        if self.packed and self.kernel == 1:
            raise bad("packed", self.packed, "use packed=True only with kernel=2 or 3")
        if self.realign and not (self.kernel == 2 and self.packed):
            raise bad("realign", self.realign, "use realign=True only with kernel=2 and packed=True")
        if self.lookahead and not (self.kernel == 2 and self.packed):
            raise bad("lookahead", self.lookahead, "use lookahead=True only with kernel=2 and packed=True")
        if self.epilogue not in EPILOGUES:
            raise bad("epilogue", self.epilogue, f"use one of {EPILOGUES}")
        if self.min_per_program < 0 or self.min_per_program % 8:
            raise bad(
                "min_per_program", self.min_per_program, "use 0 or a positive multiple of 8 (e.g. 32768)"
            )
        if self.interleave < 0 or self.interleave % 8:
            raise bad("interleave", self.interleave, "use 0 or a positive multiple of 8 (e.g. 8192)")
        if (self.min_per_program or self.interleave) and not self.programs_per_sm:
            field = "min_per_program" if self.min_per_program else "interleave"
            raise bad(
                field, getattr(self, field), "use it with a persistent grid (programs_per_sm > 0), or 0"
            )

    @property
    def tag(self) -> str:
        """A short readable name, e.g. ``p8/b2048/w4/1p`` (persistent) or ``c16384/b1024/w4/2p`` (rows);
        kernel 2 adds ``/k2`` (``/k2w`` when packed), e.g. ``p8/b4096/w4/1p/k2w``; then ``/ew`` (wide
        epilogue), ``/s`` (streaming hints), ``/m32k`` (min_per_program), ``/i8k`` (interleave),
        ``/ra`` (realign), ``/la`` (lookahead), ``/pdl`` (dependent launch)."""
        grid = f"p{self.programs_per_sm}" if self.programs_per_sm else f"c{self.chunk}"
        k = "" if self.kernel == 1 else f"/k{self.kernel}{'w' if self.packed else ''}"
        extra = {"loop": "", "wide": "/ew"}[self.epilogue]
        extra += "/s" if self.stream else ""
        extra += f"/m{_k(self.min_per_program)}" if self.min_per_program else ""
        extra += f"/i{_k(self.interleave)}" if self.interleave else ""
        extra += "/ra" if self.realign else ""
        extra += "/la" if self.lookahead else ""
        extra += "/pdl" if self.pdl else ""
        return f"{grid}/b{self.block}/w{self.warps}/{'1p' if self.one_pass else '2p'}{k}{extra}"


def _k(n: int) -> str:
    """``32768`` -> ``32k``; other counts as they are."""
    return f"{n >> 10}k" if n and n % 1024 == 0 else str(n)


# Kernel 3 takes at most this many rows per launch, as arguments.
ENTRY_SLOTS = 8


def usable(cfg: RowsConfig, *, few_aligned: bool, stats: bool, spread: bool) -> bool:
    """Whether ``cfg`` can run a launch: kernel 3 only on ``few_aligned`` rows (at most ``ENTRY_SLOTS``, each
    with a source and 16-byte aligned on both sides), without statistics or with spread ones; the others
    always."""
    return cfg.kernel != 3 or (few_aligned and (spread or not stats))


# The kernels as they were before this table existed: 16 Ki-element rows, one program each, 1024-element
# tiles on 4 warps, statistics reduced by a second launch. Kept as a sweep baseline.
# Rows of a spread statistics buffer per SM (``spread_stats_rows``): the most programs per SM a flatten
# config launches (the table's p16; the sweep's candidates stay at or below it). A launch with more programs than
# the buffer has rows reduces on the device instead (correct, one ticket or launch slower).
SPREAD_ROWS_PER_SM = 16
# ... and one row per this many elements of each entry: configs with one program per chunk row (chunks of
# at least this many elements) spread too.
SPREAD_MIN_CHUNK = 2048
# Under the interpreter there are no SMs; this many stand in, so a persistent grid of a few programs per "SM"
# still gives each program several rows on CI-sized inputs (the stride loop gets exercised).
INTERP_SMS = 2


LEGACY = RowsConfig(chunk=1 << 14, block=1024, warps=4, programs_per_sm=0, one_pass=False)

# NOTE: (max elements, config) per family, first match wins; the last bound must be None (no limit).
# Measured: H200, the 2026-11-30 sweep at aa4d390
# (`bench_triton.py --sweep`, its suggested table as printed). Per swept bucket size (16 / 64 / 256 MB of
# bf16), the config with the best mean fraction of the device copy ceiling (4169 GB/s) over the family's ops
# (flatten: bf16 and fp32 sources with statistics; scatter: fp32 -> bf16 and bf16 -> bf16) and both layouts
# (odd, aligned), CUDA-graph time; bounds halfway in log scale between swept sizes (32 MB and 128 MB of bf16
# = 16 Mi and 64 Mi elements). The comments give that mean and the LEGACY config's on the same runs.
# Re-run the sweep and replace this table when the kernels or the hardware change.
HEURISTIC: dict[str, tuple[tuple[int | None, RowsConfig], ...]] = {
    "flatten": (
        # 16 MB: 67.0% of the copy ceiling (legacy 54.4%); p4/b4096/k2w 66.6%, p8/b2048/k2 66.3%
        (
            16777216,
            RowsConfig(chunk=0, block=2048, warps=4, programs_per_sm=8, one_pass=True, kernel=2, packed=True),
        ),
        # 64 MB: 76.6% (legacy 74.1%); p8/b2048/w4/1p ties (76.6%): both clamp to the 5 programs per SM
        # that fit kernel 1's b2048/w4 statistics variants
        (67108864, RowsConfig(chunk=0, block=2048, warps=4, programs_per_sm=16, one_pass=True)),
        # 256 MB: 83.7% (legacy 83.2%)
        (None, RowsConfig(chunk=0, block=1024, warps=4, programs_per_sm=8, one_pass=True)),
    ),
    # The 2026-12-01 sweep of this family (2291f87), H200,
    # ceiling 4199 GB/s, means over the spread ops (bf16 and fp32 sources) and both layouts; what the engine runs.
    "flatten_spread": (
        # 16 MB with at most ENTRY_SLOTS aligned rows: kernel 3, one 2048-element tile per program on 4 warps
        # with streaming hints, a dependent launch. The 2026-12-01 dependent-launch sweep (66a1e5b,
        # ceiling 4132 GB/s): bf16 86.0%, fp32 source 90.8% (torch's copy_ of the bf16 bytes
        # 84.5%); without the dependent launch 81.5 / 87.8%; c4096/b4096/w8 85.7 / 89.8% (83.6 / 87.3% without)
        (
            16777216,
            RowsConfig(chunk=2048, block=2048, warps=4, programs_per_sm=0, kernel=3, packed=True, stream=True, pdl=True),
        ),
        # 16 MB otherwise: 80.5% (bf16 79.6%, fp32 source 81.5%; the same ops reduced in the launch: 63-65% / 67-71%)
        (
            16777216,
            RowsConfig(
                chunk=0,
                block=2048,
                warps=4,
                programs_per_sm=8,
                one_pass=True,
                kernel=2,
                packed=True,
                stream=True,
                realign=True,
            ),
        ),
        # 64 MB: 88.0% (bf16 87.9 / 85.1% aligned / odd), 256 MB: 94.2% (bf16 95.6 / 90.8%), with a dependent launch
        # (the 2026-12-01 sweep of kernel 2 with dependent launches, 66a1e5b: 87.0 / 93.9% without it)
        (
            None,
            RowsConfig(
                chunk=8192, block=4096, warps=4, programs_per_sm=0, one_pass=True, kernel=2, packed=True, realign=True,
                pdl=True,
            ),
        ),
    ),
    "scatter": (
        # 16 MB with at most ENTRY_SLOTS aligned rows: kernel 3 (the 2026-12-01 sweeps, 66a1e5b): the fp32 -> bf16 cast
        # 95.0%, the bf16 copy 87.2% with streaming hints and a dependent launch (92.1 / 84.9% without the
        # dependent launch, 88.6 / 80.0% without either; kernel 1's c4096/b1024/w4/2p/s: 89.7 / 75.2%)
        (
            16777216,
            RowsConfig(chunk=2048, block=2048, warps=4, programs_per_sm=0, kernel=3, packed=True, stream=True, pdl=True),
        ),
        # 16 MB otherwise, 64 MB and 256 MB: kernel 1 on 4096-element rows, a dependent launch (2026-12-01, 66a1e5b):
        # 16 MB 86.2% with streaming hints (83.3% without the dependent launch; kernel 2's p8/b2048/w4 81.3%);
        # 64 MB 87.9% (cast 94.2 / 95.7% odd / aligned; 86.6% without it; with hints 86.3%); 256 MB 93.9% with
        # hints (93.4% without them)
        (16777216, RowsConfig(chunk=4096, block=1024, warps=4, programs_per_sm=0, one_pass=False, stream=True, pdl=True)),
        (67108864, RowsConfig(chunk=4096, block=1024, warps=4, programs_per_sm=0, one_pass=False, pdl=True)),
        (None, RowsConfig(chunk=4096, block=1024, warps=4, programs_per_sm=0, one_pass=False, stream=True, pdl=True)),
    ),
    "scatter_sr": (
        # 16 MB with at most ENTRY_SLOTS aligned rows: kernel 3 (the 2026-12-01 sweeps, 66a1e5b), 82.5% with
        # streaming hints and a dependent launch (79.3% without it, 75.8% without either; the row below 69.3%)
        (16777216, RowsConfig(chunk=2048, block=2048, warps=4, programs_per_sm=0, kernel=3, stream=True, pdl=True)),
        # 16 MB otherwise and 64 MB: kernel 1 on 4096-element rows with streaming hints and a dependent launch
        # (2026-12-01, 66a1e5b): 76.9% (70.1% plain) and 85.2% (83.1% plain); 256 MB: without hints 88.7% (88.4%
        # without the dependent launch; the LEGACY config, this row before, 85.5%)
        (16777216, RowsConfig(chunk=4096, block=1024, warps=4, programs_per_sm=0, one_pass=False, stream=True, pdl=True)),
        (67108864, RowsConfig(chunk=4096, block=1024, warps=4, programs_per_sm=0, one_pass=False, stream=True, pdl=True)),
        (None, RowsConfig(chunk=4096, block=1024, warps=4, programs_per_sm=0, one_pass=False, pdl=True)),
    ),
}

_force_lock = threading.Lock()
_forced: dict[str, RowsConfig] = {}


def choose(family: str, numel: int, *, kernel3: bool = True) -> RowsConfig:
    """The config for ``numel`` elements of op ``family``: a forced one if :func:`forced` is active, else the
    table's first row whose bound holds; with ``kernel3=False`` (the launch cannot run kernel 3:
    :func:`usable`) kernel-3 rows (forced or not) are passed over."""
    cfg = _forced.get(family)
    if cfg is not None and (kernel3 or cfg.kernel != 3):
        return cfg
    for bound, c in HEURISTIC[family]:
        if (bound is None or numel <= bound) and (kernel3 or c.kernel != 3):
            return c
    raise AssertionError(f"HEURISTIC[{family!r}] has no unbounded last row without kernel 3")


def is_forced(family: str) -> bool:
    """Whether :func:`forced` currently overrides ``family``'s table."""
    return family in _forced


@contextlib.contextmanager
def forced(**by_family: RowsConfig | None) -> Iterator[None]:
    """Within the block, launches of the given families use the given configs (``None``: the table's).

    Process-wide (not per thread): meant for benchmarks and tests. Example:
    ``with forced(flatten=RowsConfig(4096, 1024, 4, 8)): ...``.
    """
    for fam in by_family:
        if fam not in FAMILIES:
            raise ValueError(f"forced({fam}=...): unknown op family, use one of {FAMILIES}")
    with _force_lock:
        saved = dict(_forced)
        for fam, cfg in by_family.items():
            if cfg is None:
                _forced.pop(fam, None)
            else:
                _forced[fam] = cfg
    try:
        yield
    finally:
        with _force_lock:
            _forced.clear()
            _forced.update(saved)


def max_resident_programs(
    *,
    warps: int,
    regs_per_thread: int,
    shared_bytes: int,
    max_threads_per_sm: int = 2048,
    regs_per_sm: int = 65536,
    shared_per_sm: int = 228 * 1024,
    max_blocks_per_sm: int = 32,
) -> int:
    """How many programs (CTAs) of this kernel fit on one SM at once (CUDA occupancy rules, NVIDIA).

    Registers are allocated per warp in units of 256; a persistent grid larger than this would run its
    surplus programs as a second wave after the first ones finished, doubling the kernel's time.
    """
    threads = warps * 32
    by_threads = max_threads_per_sm // threads
    per_warp = -(-max(regs_per_thread, 1) * 32 // 256) * 256
    by_regs = (regs_per_sm // per_warp) // warps
    by_shared = shared_per_sm // shared_bytes if shared_bytes > 0 else max_blocks_per_sm
    return max(1, min(by_threads, by_regs, by_shared, max_blocks_per_sm))


def one_per_path(cands: Iterable[RowsConfig]) -> list[RowsConfig]:
    """One config per code path of the row kernels (kernel, packed, grid kind, passes, realign, lookahead,
    dependent launch, streaming hints, epilogue, interleave, min_per_program: every constexpr branch), the one
    with the smallest tiles (the cheapest under the interpreter), paths in order of first appearance. For the
    CPU interpreter's tests and rehearsal: they check each path, not each tile size (the GPU runs them all)."""
    best: dict[tuple[object, ...], RowsConfig] = {}
    for c in cands:
        key = (c.kernel, c.packed, c.programs_per_sm > 0, c.one_pass, c.realign, c.lookahead, c.pdl, c.stream,
               c.epilogue, c.interleave > 0, c.min_per_program > 0)  # fmt: skip
        if key not in best or (c.block, c.chunk, c.warps) < (best[key].block, best[key].chunk, best[key].warps):
            best[key] = c
    return list(best.values())


def sweep_candidates(family: str) -> list[RowsConfig]:
    """The configurations ``bench_triton.py --sweep`` times for ``family`` (LEGACY first), bounded so that
    a sweep over three sizes and two layouts stays within a few minutes of one H200."""
    base = [
        LEGACY,
        RowsConfig(4096, 1024, 4, 0, one_pass=False),  # the legacy kernel shape with 4x more programs
        RowsConfig(0, 1024, 4, 8),
        RowsConfig(0, 1024, 4, 16),
        RowsConfig(0, 2048, 4, 8),
        RowsConfig(0, 2048, 4, 16),
        RowsConfig(0, 2048, 8, 4),
        RowsConfig(0, 2048, 8, 8),
        RowsConfig(0, 4096, 8, 4),
    ]
    if family == "flatten":
        # NOTE: the 2026-11-30 sweep (aa4d390): the
        # kernel-1 w8 configs lost by 5-25 points on the bf16 statistics (2-5 programs per SM fit), c4096 by
        # 8-15, the kernel-2 two-launch, p12 and b4096 non-packed ones by 1-8; they are dropped for the
        # fixed-cost variants below (issue #4's last item, docs/triton_kernels.md "Fixed costs"), one change
        # at a time on the session's best configs, then combined. Registers per thread as compiled there:
        # kernel 2 packed 40 (12 programs per SM fit), kernel 1 b1024/w4 64 (bf16) / 48 (fp32 source).
        k2w = dict(kernel=2, packed=True)
        cands = [
            LEGACY,
            # the 2026-11-30 winners (HEURISTIC and the best per op): baselines of the new variants
            RowsConfig(0, 1024, 4, 8),
            RowsConfig(0, 2048, 4, 16),
            RowsConfig(0, 1024, 4, 8, one_pass=False),  # what the single-launch reduction buys
            RowsConfig(0, 2048, 4, 8, kernel=2),
            RowsConfig(0, 2048, 4, 8, **k2w),
            RowsConfig(0, 4096, 4, 4, **k2w),
            # the last-ticket reduction in fewer round trips (wide chunks)
            RowsConfig(0, 2048, 4, 8, epilogue="wide", **k2w),
            RowsConfig(0, 1024, 4, 8, epilogue="wide"),
            # fewer, longer programs on small buckets (16 MB: 512 programs instead of ~1056)
            RowsConfig(0, 2048, 4, 8, epilogue="wide", min_per_program=16384, **k2w),
            # 8 vectors of 16 bytes per thread in flight per iteration (b4096: 4)
            RowsConfig(0, 8192, 4, 8, epilogue="wide", **k2w),
            # streaming cache hints
            RowsConfig(0, 2048, 4, 8, epilogue="wide", stream=True, **k2w),
            RowsConfig(0, 1024, 4, 8, epilogue="wide", stream=True),
            # shares dealt round-robin in ~8 Ki-element pieces (one piece per program at 16 MB: no change)
            RowsConfig(0, 2048, 4, 8, epilogue="wide", interleave=8192, **k2w),
            # NOTE: the 2026-11-30 variant sweep: p4/b4096/k2w/et and
            # p16/b1024/ew/s/i4k lost to their bases at every size, p16/b1024 ran as p8/b1024 (8 programs per
            # SM fit its 64 registers: the same launch, within 0.2 points); dropped for these three. The tree
            # epilogue lost to the loop and wide ones at every size on both kernels (e.g. 16 MB bf16: 53.2% vs
            # 57.6 / 58.1%) and kernel 1's interleave never beat its base (p8/b1024/ew): dropped on 2026-12-01 (e6e6348).
            # per-byte cost: rows not aligned on both sides (the odd layout from 64 MB up) as whole 16-byte
            # vectors instead of 2-byte loads and stores (docs/triton_kernels.md, "Per-byte costs in the
            # SASS"), on the 2026-11-30 winners of kernel 2
            RowsConfig(0, 2048, 4, 8, realign=True, **k2w),
            RowsConfig(0, 2048, 4, 8, epilogue="wide", min_per_program=16384, realign=True, **k2w),
            RowsConfig(0, 2048, 4, 8, epilogue="wide", interleave=8192, realign=True, **k2w),
            # per-byte cost on aligned rows: the next tile's loads ahead of this tile's stores and statistics
            # (offline SASS, 2026-12-01: ptxas keeps them after the statistics, ahead of the stores only)
            RowsConfig(0, 2048, 4, 8, lookahead=True, **k2w),
            RowsConfig(0, 2048, 4, 8, realign=True, lookahead=True, **k2w),
        ]
    elif family == "flatten_spread":
        # NOTE: a stripped probe (2026-12-01; docs/triton_kernels.md "Spread statistics"): without a
        # reduction in the launch, one 8-16 KB tile per program and no persistent loop reached 86-89% / 94-95%
        # at 64 / 256 MB on one contiguous bf16 tensor (83.5% at 16 MB with 8 KB tiles). In the 2026-12-01
        # flatten sweep, on the spread ops, c4096/b4096/w4/k2w won from 64 MB up and p8/b2048/k2w/ew/s at 16 MB;
        # c4096/b4096/w8, c8192/b8192/w8 and c8192/b4096/w8 lost by 3-20 points. The rest of the flatten list
        # is left out: its epilogue variants do nothing here. Candidates: that sweep's winners and their
        # realigned twins (the odd layout), 2048-element tiles (the probe's 16 MB best), two tiles per program.
        k2w = dict(kernel=2, packed=True)
        cands = [
            LEGACY,
            RowsConfig(0, 2048, 4, 8, **k2w),
            RowsConfig(0, 2048, 4, 8, stream=True, realign=True, **k2w),
            RowsConfig(4096, 4096, 4, 0, **k2w),
            RowsConfig(4096, 4096, 4, 0, realign=True, **k2w),
            RowsConfig(4096, 4096, 4, 0, stream=True, **k2w),
            RowsConfig(8192, 4096, 4, 0, realign=True, **k2w),
            # NOTE: 2026-12-01 (66a1e5b): kernel 3 (the rows as arguments; only on buckets of at most ENTRY_SLOTS aligned
            # rows: the 16 MB layouts), one tile per program as in the entry-argument probe. Made room for
            # by c4096/b2048/w4/k2w and c2048/b2048/w2/k2w (the sweep before: behind c4096/b4096 everywhere). Sweep 1:
            # c4096/b4096/w8/k3w/s won (83.4 / 85.2%), c2048/b2048/w8 (52 / 70%) and c8192/b4096/w8 (79 / 77%)
            # lost and left. Sweep 2: 16 warps lost by 6-35 points and left; c2048/b2048/w4/k3w/s 78.7 / 87.1%.
            # Sweep 3: the dependent launch (/pdl) won at 16 MB, c2048/b2048/w4/k3w/s/pdl 86.0 / 90.8% (bf16 /
            # fp32 source); left: kernel 3 without hints and c4096/b4096/w4 (1-3 points behind), and the
            # losers by 5-20 points: p8/b1024, p16/b2048, c4096/b1024/2p, c2048/b2048/k2w(/ra),
            # p8/b2048/k2w/m16k/ra. Now /pdl on kernel 2 (the buckets kernel 3 cannot take; 64 MB up).
            *[RowsConfig(c, c, w, 0, kernel=3, packed=True, stream=True) for c, w in ((2048, 4), (4096, 8))],
            *[RowsConfig(c, c, w, 0, kernel=3, packed=True, stream=True, pdl=True) for c, w in ((2048, 4), (4096, 8))],
            RowsConfig(0, 2048, 4, 8, stream=True, realign=True, pdl=True, **k2w),
            RowsConfig(8192, 4096, 4, 0, realign=True, pdl=True, **k2w),
            RowsConfig(8192, 4096, 4, 0, stream=True, realign=True, pdl=True, **k2w),
            # Sweep 4: c8192/b4096/w4/k2w/ra/pdl won from 64 MB up (88.0 / 94.2%; 87.0 / 93.9% without /pdl), the
            # odd 64 MB layout at 85.1 / 84.2% (bf16 / fp32 source); c4096/b4096/k2w/ra/pdl 5-8 points behind, left.
            # Now for that layout: more elements per program, the next tile's loads ahead, 8 warps.
            RowsConfig(16384, 4096, 4, 0, realign=True, pdl=True, **k2w),
            RowsConfig(8192, 4096, 4, 0, realign=True, lookahead=True, pdl=True, **k2w),
            RowsConfig(8192, 8192, 8, 0, realign=True, pdl=True, **k2w),
        ]
    else:
        cands = list(base)
    if family == "scatter":  # the same tiles for the plain copies (bf16 -> bf16 at 74-86%)
        cands += [
            RowsConfig(0, 2048, 4, 8, kernel=2),
            RowsConfig(0, 4096, 4, 8, kernel=2, packed=True),
            # many short rows in program order won from 64 MB up (c4096): the persistent grid interleaved
            RowsConfig(0, 2048, 4, 8, kernel=2, interleave=8192),
            RowsConfig(4096, 1024, 4, 0, one_pass=False, stream=True),
            # bf16 -> bf16 from a flat buffer at odd offsets as whole vectors (realign)
            RowsConfig(0, 2048, 4, 8, kernel=2, packed=True, realign=True),
        ]
    if family in ("scatter", "scatter_sr"):
        # Kernel 3 (2026-12-01, 66a1e5b), for the buckets it can take. Sweep 1: c2048/b2048/w4 won (cast 88.6%, SR 75.8%);
        # 8 warps and 1024-element tiles on 4-8 warps lost by 8-45 points. Sweep 2: with streaming hints 90.4 /
        # 78.4% (bf16 copy 82.3%); c4096/b4096/w4 and 2048-element tiles on 2 warps 1-8 points behind, left.
        # Sweep 3: the dependent launch (/pdl) won at 16 MB (cast 95.0%, bf16 copy 87.2%, SR 82.5%); left:
        # c4096/b4096/w8 and c1024/b1024/w2 without hints (1-5 points behind c2048/b2048/w4). Now /pdl on the
        # 64-256 MB rows too.
        pk = family == "scatter"
        cands += [
            RowsConfig(2048, 2048, 4, 0, kernel=3, packed=pk),
            RowsConfig(2048, 2048, 4, 0, kernel=3, packed=pk, stream=True),
            RowsConfig(2048, 2048, 4, 0, kernel=3, packed=pk, stream=True, pdl=True),
            RowsConfig(4096, 4096, 8, 0, kernel=3, packed=pk, stream=True, pdl=True),
            RowsConfig(4096, 1024, 4, 0, one_pass=False, stream=True, pdl=True),
            RowsConfig(4096, 1024, 4, 0, one_pass=False, pdl=True),
        ]
    if family == "scatter_sr":
        cands = [LEGACY, *[c for c in cands[1:] if c.block <= 2048 and c.programs_per_sm != 16]]
    for _, c in HEURISTIC[family]:
        if c not in cands:
            cands.append(c)
    return cands
