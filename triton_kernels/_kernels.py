"""Triton kernels and their launchers. Imported lazily by the package, never at package import.

Layering, per op: private ``@triton.jit`` kernel -> plain launcher here (picks BLOCK / num_warps, builds
work tables) -> public function in :mod:`hf_superoffload.triton_kernels` (validation, dispatch, twin).

Conventions shared by every kernel:

* bf16 never appears as a Triton dtype. bf16 tensors are passed as ``int16`` views and converted on the
  bits: bf16 -> fp32 is ``bits << 16``; fp32 -> bf16 is explicit round-to-nearest-even (or stochastic
  rounding) on the uint32 pattern. That is bit-exact on the GPU *and* under ``TRITON_INTERPRET=1``, whose
  numpy-backed ``x.to(tl.bfloat16)`` does not round like torch.
* "kind" constexprs name a storage format: ``F32 = 0``, ``BF16 = 1`` (int16 bits), ``F16 = 2``.
* Offsets are int64 (buckets of more than 2**31 elements are fine).
* Multi-tensor ops (flatten, scatter) share one kernel, :func:`_rows_kernel` (or its 2-D-tile variant
  :func:`_rows2_kernel`, ``RowsConfig.kernel == 2``), launched once per dtype group over a device *work
  table* of rows ``[source offset, destination offset, flags, n]`` (see :mod:`._tables`).
  How the bucket is cut into rows, the tile width, the warps, the grid (persistent or one program per row)
  and how the statistics are reduced are a :class:`._configs.RowsConfig`, chosen from the bucket's size by
  a fixed table (:func:`._configs.choose`): no autotuning at run time. Element offsets from a base pointer
  argument, rather than raw addresses cast with ``tl.pointer_type``, keep the base's 16-byte alignment
  (from Triton's argument specialisation) visible to the compiler; the per-row flags say which side is
  16-byte aligned, and the kernel picks the matching unmasked tile loop (16-byte vector loads / stores on
  the aligned sides), then a masked tail. The plan (tables, grids, statistics scratch) is cached per exact
  set of addresses, so a repeated call uploads and allocates nothing.
* Non-contiguous inputs never reach a launcher: the public functions make gradients contiguous (a
  temporary copy) and scatter into a contiguous temporary before ``copy_`` for non-contiguous params.
* NaN -> bf16 keeps sign and the top payload bits and sets the quiet bit: ``(bits >> 16) | 0x40``. torch
  itself is not consistent here (its vectorised CPU path writes ``0xFFFF``, its scalar path ``0x7FC0``), so
  callers and tests compare NaN-ness, and every other value bit for bit.

Whether these are compiled or interpreted is fixed when this module is first imported: ``triton.jit``
reads ``TRITON_INTERPRET`` at decoration time, and Triton's own ``tl.randint`` / reduction helpers were
decorated when ``triton`` itself was imported. :func:`mode` reports which one this process got.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from ..cpu_ext import AdamWHyper
from . import _configs, _interpreter
from ._configs import RowsConfig
from ._tables import PlanCache, aligned16, chunk_rows, interleaved_rows
from .reference import sr_keys

# torch dtype -> (storage kind constexpr, element size in bytes)
_KIND: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (0, 4),
    torch.bfloat16: (1, 2),
    torch.float16: (2, 2),
}
SUPPORTED_DTYPES = frozenset(_KIND)


_MODE: str | None = None


def mode() -> str:
    """``"interpreter"``, ``"native"`` or ``"inconsistent"`` (Triton imported before TRITON_INTERPRET was set)."""
    global _MODE
    if _MODE is None:
        ours = _interpreted(_upcast_kernel)
        stdlib = _interpreted(tl.randint)
        _MODE = "inconsistent" if ours != stdlib else ("interpreter" if ours else "native")
    return _MODE


def _tile(native: int) -> int:
    """The tile (BLOCK) for this process: ``native`` when compiled, at least 4096 under the interpreter.

    NOTE: the interpreter runs each tile's ~50 ops through Python at tens of microseconds apiece whatever
    the tile size, so a 4x larger tile makes CI ~4x faster (measured on the 2-core CI box: flatten of
    2**20 + 3 elements 3.7 s at 1024 vs ~1 s at 4096). 4096 still leaves 4 tiles per 16 Ki chunk, so the
    per-program loop and its tail mask keep being exercised.
    """
    return max(native, 4096) if mode() == "interpreter" else native


def _as_storage(t: torch.Tensor) -> torch.Tensor:
    """The view a kernel addresses ``t`` through (bf16 -> int16 bits)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


# --------------------------------------------------------------------------------------------- helpers


@triton.jit
def _bf16_bits_to_f32(b):
    """int16 bf16 bit patterns -> exact fp32 values."""
    return (b.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(x, rnd, STOCHASTIC: tl.constexpr):
    """fp32 -> int16 bf16 bit patterns, round to nearest even (or stochastic with random ``rnd``).

    RNE: ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``, which also maps +-Inf to +-Inf and rounds values past
    the largest bf16 to Inf exactly like torch. Stochastic: ``(u + (rnd & 0xFFFF)) >> 16`` rounds the
    magnitude up with probability (low 16 bits) / 2**16, so the expectation is the input and the result is
    always one of its two bf16 neighbours (exact inputs are unchanged). NaN: sign and high payload kept,
    quiet bit set.
    """
    u = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        r = u + (rnd & 0xFFFF).to(tl.uint32)
    else:
        r = u + ((u >> 16) & 1) + 0x7FFF
    hi = r >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    hi = tl.where(is_nan, (u >> 16) | 0x40, hi)
    return hi.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _to_f32(x, KIND: tl.constexpr):
    """Loaded storage values of ``KIND`` -> fp32 (exact for every supported kind)."""
    if KIND == 1:
        return _bf16_bits_to_f32(x)
    else:
        return x.to(tl.float32)


@triton.jit
def _from_f32(x, rnd, KIND: tl.constexpr, STOCHASTIC: tl.constexpr):
    """fp32 -> storage values of ``KIND`` (bf16: explicit RNE / stochastic on the bits; fp16: RNE cast)."""
    if KIND == 1:
        return _f32_to_bf16_bits(x, rnd, STOCHASTIC)
    elif KIND == 2:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def _nonfinite(v):
    """1 where the fp32 value is +-Inf or NaN (exponent all ones), else 0; exact on the bits."""
    return ((v.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000).to(tl.int32)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """``tl.load`` with ``mask`` (zeros elsewhere) only when MASKED: an unmasked load can be vectorised."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr):
    """``tl.store`` with ``mask`` only when MASKED."""
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _sload(ptrs, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """:func:`_load` of data read once: with STREAM, ``evict_first`` (``RowsConfig.stream``)."""
    if STREAM:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
        else:
            return tl.load(ptrs, eviction_policy="evict_first")
    else:
        return _load(ptrs, mask, MASKED)


@triton.jit
def _sstore(ptrs, value, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """:func:`_store` of data written once: with STREAM, a streaming store (``.cs``)."""
    if STREAM:
        if MASKED:
            tl.store(ptrs, value, mask=mask, cache_modifier=".cs")
        else:
            tl.store(ptrs, value, cache_modifier=".cs")
    else:
        _store(ptrs, value, mask, MASKED)


@triton.jit
def _aligned_off(off, V: tl.constexpr):
    """``off`` rebuilt as ``(off // V) * V``: the same value for a row known (from its flags) to be aligned,
    but now a *new* SSA value whose divisibility the compiler derives by itself. (``tl.multiple_of`` would
    tag the defining load and leak the claim into the unaligned branches and the tail.)"""
    return (off // V) * V


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finaliser: a bijection on uint32 with full avalanche."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _noise16(g, k0, k1):
    """16 uniform random bits (uint32 < 2**16) per element from its int64 counter ``g`` and 31-bit keys.

    Two rounds of :func:`_fmix32` over (low word ^ k0) and then (high word ^ k1): ~12 integer ops per
    element instead of a 10-round Philox (which made the stochastic-rounding scatter ALU-bound at ~40% of
    the copy ceiling). For a fixed key and high word the map is a bijection of the low word, so the noise of
    any 2**32 consecutive counters is exactly uniform. :func:`.reference.noise16` is the bit-exact twin.
    """
    lo = g.to(tl.uint32)
    hi = (g >> 32).to(tl.uint32)
    x = _fmix32(lo ^ k0.to(tl.uint32))
    x = _fmix32(x ^ hi ^ k1.to(tl.uint32))
    return x >> 16


@triton.jit
def _convert(x, ctr, k0, k1, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Loaded ``SRC_KIND`` storage -> ``DST_KIND`` storage. Same kind: the bits unchanged. To bf16: RNE, or
    stochastic rounding keyed by the element's counter ``ctr`` when STOCHASTIC."""
    if SRC_KIND == DST_KIND:
        return x
    else:
        xf = _to_f32(x, SRC_KIND)
        if STOCHASTIC and DST_KIND == 1:
            return _f32_to_bf16_bits(xf, _noise16(ctr, k0, k1), True)
        else:
            return _from_f32(xf, 0, DST_KIND, False)


# --------------------------------------------------------------------------- rows: flatten and scatter

# Kernel 3's row offsets travel biased by this much, so that Triton types every one of them int64 whatever
# its value (an argument within the int32 range would be typed i32: another compiled variant per pattern).
# Element offsets between two allocations stay far below it.
_ARG_BIAS_HOST = 1 << 50
_ARG_BIAS = tl.constexpr(_ARG_BIAS_HOST)
# Row flag bits of the work tables.
_HAS_SRC = 1  # the row has a source (flatten: a None gradient has not; the kernel writes zeros)
_SRC_AL = 2  # the row's source address is 16-byte aligned
_DST_AL = 4  # the row's destination address is 16-byte aligned
_ALL_AL = _HAS_SRC | _SRC_AL | _DST_AL  # what kernel 3 needs of every row


@triton.jit
def _copy_tiles(
    src, dst, stop, lane, ctr_base, k0, k1, acc_sq, acc_bad,
    SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, BLOCK: tl.constexpr,
):  # fmt: skip
    """Whole tiles ``[0, stop)`` without masks; returns the updated stats accumulators."""
    for start in range(0, stop, BLOCK):
        offs = start + lane
        x = _sload(src + offs, None, False, STREAM)
        y = _convert(x, ctr_base + offs, k0, k1, SRC_KIND, DST_KIND, STOCHASTIC)
        _sstore(dst + offs, y, None, False, STREAM)
        if STATS:
            v = _to_f32(y, DST_KIND)
            acc_sq += v * v
            acc_bad += _nonfinite(v)
    return acc_sq, acc_bad


@triton.jit
def _next_row(table_ptr, r, hi):
    """Row ``r + 1``'s ``[src_off, dst_off, flags, n]`` (zeros at ``hi``): loaded one row ahead of its use."""
    nxt = table_ptr + (r + 1) * 4  # int32 is plenty: a table has far fewer than 2**29 rows
    more = r + 1 < hi
    return (tl.load(nxt, mask=more, other=0), tl.load(nxt + 1, mask=more, other=0),
            tl.load(nxt + 2, mask=more, other=0), tl.load(nxt + 3, mask=more, other=0))


@triton.jit
def _sum_parts(sq_ptr, bad_ptr, n, EPI_W: tl.constexpr, EPI_CNT64: tl.constexpr):
    """``(sum of sq_ptr[:n], sum of bad_ptr[:n])`` in ``EPI_W``-wide chunks (a fixed order); the counts in
    int64 when EPI_CNT64, else int32."""
    lane = tl.arange(0, EPI_W)
    tot_sq = tl.zeros([EPI_W], dtype=tl.float32)
    if EPI_CNT64:
        tot_bad = tl.zeros([EPI_W], dtype=tl.int64)
    else:
        tot_bad = tl.zeros([EPI_W], dtype=tl.int32)
    for start in range(0, n, EPI_W):
        offs = start + lane
        m = offs < n
        tot_sq += tl.load(sq_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
        b = tl.load(bad_ptr + offs, mask=m, other=0, cache_modifier=".cg")
        if EPI_CNT64:
            tot_bad += b.to(tl.int64)
        else:
            tot_bad += b
    return tl.sum(tot_sq, axis=0), tl.sum(tot_bad, axis=0)


@triton.jit
def _add_pair(a_sq, a_bad, b_sq, b_bad):
    """Combine of the joint statistics reduction: ``tl.reduce((sq, bad), axis, _add_pair)``."""
    return a_sq + b_sq, a_bad + b_bad


def _interpreted(fn: Any) -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        return False
    return isinstance(fn, InterpretedFunction)


# Compiled, both statistics go through one reduction (one shared-memory exchange instead of two:
# docs/triton_kernels.md, "Rows as arguments"). The interpreter runs a reduction with a Python combine
# element by element, ~30x two ``tl.sum`` (0.6 s per 2048-element tile; it made CI's interpreter tests
# minutes longer): there the two sums go separately. Same contract either way (deterministic per config).
_JOINT = tl.constexpr(not _interpreted(_add_pair))
if _interpreted(_add_pair):  # skip the interpreter's walk of triton.language on every helper call
    _interpreter.skip_repeated_lang_patches()


@triton.jit
def _sum_pair(a, b):
    """``(sum(a), sum(b))`` over axis 0, jointly where compiled (see ``_JOINT``)."""
    if _JOINT:
        return tl.reduce((a, b), 0, _add_pair)
    else:
        return tl.sum(a, axis=0), tl.sum(b, axis=0)


@triton.jit
def _publish_stats(acc_sq, acc_bad, part_sq_ptr, part_bad_ptr, part_base, counter_ptr, stats_ptr, pid, n_prog,
                   old_sq, old_bad, ONE_PASS: tl.constexpr, W: tl.constexpr, EPI_W: tl.constexpr,
                   EPI_CNT64: tl.constexpr, SPREAD: tl.constexpr):  # fmt: skip
    """A rows program's statistics: its partial sums into the partials buffer; with SPREAD into its own row
    ``part_base + pid`` of ``stats`` (``[rows, 2]``: ``old_sq`` / ``old_bad`` are that row as the program
    found it, loaded when it started), no reduction (the reader sums the rows); with ONE_PASS the program that
    draws the last ticket adds every partial (in a fixed order) to ``stats`` and resets the counter for the
    next launch on this stream (``RowsConfig.epilogue``):

    * ``EPI_W == 0`` (``"loop"``): the partials in ``W``-wide chunks, ``stats`` after them, counts in int64;
    * ``EPI_W > 0`` (``"wide"``): ``EPI_W``-wide chunks (the launcher sizes them: the next power of two >= the
      grid, at most ``_EPI_MAX`` partials per warp), ``stats`` loaded first.

    With EPI_W > 0 the counts are summed in int64 only when ``EPI_CNT64`` (a launch of 2**31 elements or
    more; below that an int32 sum cannot overflow). Every order is fixed: deterministic."""
    if SPREAD:  # both sums in one reduction: one shared-memory exchange instead of two
        s, c = _sum_pair(acc_sq, acc_bad)
    else:
        s = tl.sum(acc_sq, axis=0)
        c = tl.sum(acc_bad, axis=0)
    if ONE_PASS and EPI_W == 0:
        # NOTE: the 2026-11-30 (aa4d390) code as it was, so that "loop" compiles to the same registers (Triton 3.6, sm_90:
        # restructured, p8/b1024/w4 bf16 went from 64 registers to 56 with spills).
        tl.store(part_sq_ptr + pid, s)
        tl.store(part_bad_ptr + pid, c)
        # acq_rel at GPU scope (Triton's default): the partials above are visible to whichever program
        # draws the last ticket, and that one sees every other program's.
        ticket = tl.atomic_add(counter_ptr, 1)
        if ticket == n_prog - 1:
            lane = tl.arange(0, W)
            tot_sq = tl.zeros([W], dtype=tl.float32)
            tot_bad = tl.zeros([W], dtype=tl.int64)
            for start in range(0, n_prog, W):
                offs = start + lane
                m = offs < n_prog
                tot_sq += tl.load(part_sq_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
                tot_bad += tl.load(part_bad_ptr + offs, mask=m, other=0, cache_modifier=".cg").to(tl.int64)
            tl.store(stats_ptr, tl.load(stats_ptr) + tl.sum(tot_sq, axis=0))
            tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + tl.sum(tot_bad, axis=0).to(tl.float32))
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch on this stream
    elif ONE_PASS:
        tl.store(part_sq_ptr + pid, s)
        tl.store(part_bad_ptr + pid, c)
        ticket = tl.atomic_add(counter_ptr, 1)  # acq_rel, as above
        if ticket == n_prog - 1:
            old_sq = tl.load(stats_ptr, cache_modifier=".cg")
            old_bad = tl.load(stats_ptr + 1, cache_modifier=".cg")
            tsq, tbad = _sum_parts(part_sq_ptr, part_bad_ptr, n_prog, EPI_W, EPI_CNT64)
            tl.store(stats_ptr, old_sq + tsq)
            tl.store(stats_ptr + 1, old_bad + tbad.to(tl.float32))
            tl.atomic_xchg(counter_ptr, 0)
    elif SPREAD:
        row = stats_ptr + (part_base + pid).to(tl.int64) * 2
        tl.store(row, old_sq + s)
        tl.store(row + 1, old_bad + c.to(tl.float32))
    else:
        tl.store(part_sq_ptr + part_base + pid, s)
        tl.store(part_bad_ptr + part_base + pid, c)


@triton.jit
def _dependent_launch(PDL: tl.constexpr):
    """PDL (the launch is a programmatic dependent launch, sm_90+): wait for the previous grid in the stream
    to complete and flush (before any memory access), then let the next PDL-launched grid start its programs
    as this one's finish (docs/triton_kernels.md, "Dependent launch"). Nothing otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _spread_row(stats_ptr, part_base, pid, SPREAD: tl.constexpr):
    """SPREAD: program ``pid``'s row of ``stats`` as it is before the launch (loaded first thing, so that
    its latency hides behind the copy); zeros otherwise."""
    if SPREAD:
        row = stats_ptr + (part_base + pid).to(tl.int64) * 2
        return tl.load(row), tl.load(row + 1)
    else:
        return 0.0, 0.0


# NOTE: only the pointers are specialised (16-byte alignment): the integers are keys and offsets, where a
# divisibility specialisation buys nothing and would compile more variants.
@triton.jit(do_not_specialize=["part_base", "k0", "k1", "rng_offset"])
def _rows_kernel(
    table_ptr,
    starts_ptr,
    src_base_ptr,
    dst_base_ptr,
    part_sq_ptr,
    part_bad_ptr,
    part_base,
    counter_ptr,
    stats_ptr,
    k0,
    k1,
    rng_offset,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    STATS: tl.constexpr,
    ONE_PASS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
    STREAM: tl.constexpr,
    EPI_W: tl.constexpr,
    EPI_CNT64: tl.constexpr,
    SPREAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Copy + cast the table's rows ``[src_off, dst_off, flags, n]``: ``dst[dst_off + i] = cast(src[src_off + i])``.

    Program ``pid`` handles rows ``starts[pid]`` to ``starts[pid + 1]`` (exclusive): one row each in the
    one-program-per-row scheme, an equal share of the elements each on a persistent grid (see
    :mod:`._configs`). The next row's descriptor is loaded before the current row is copied, so its latency
    overlaps the copy. Offsets are in elements from the base pointers: unlike an int -> pointer cast,
    ``base + offset`` keeps the base's 16-byte alignment visible to the compiler. Whole tiles run
    unmasked, with 16-byte vector loads / stores on the sides the row's flags say are aligned; then a
    masked tail. Rows without a source (flatten's None gradients) go entirely through the masked loop,
    loading zeros.

    STATS: each program sums the squares and counts the non-finite values it *stored* (fp32, in registers)
    and writes one partial. ONE_PASS: the program that finishes last (a ticket from an acq_rel atomic on
    ``counter_ptr``) adds all partials, in program order, to ``stats`` and resets the counter: one launch,
    deterministic (the row -> program assignment is fixed). Else ``_stats_finalize_kernel`` does that as a
    second launch. SPREAD: each program adds its partial into its own row ``part_base + pid`` of ``stats``
    (``[rows, 2]``) and nothing reduces them in the launch: the reader sums the rows.

    STOCHASTIC (fp32 -> bf16 scatter): the counter of element ``i`` of a row is ``src_off + i + rng_offset``,
    i.e. ``offset`` + its index in the flat buffer, independent of the launch layout. PDL: see
    :func:`_dependent_launch`.
    """
    _dependent_launch(PDL)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    acc_bad = tl.zeros([BLOCK], dtype=tl.int32)
    old_sq, old_bad = _spread_row(stats_ptr, part_base, pid, SPREAD)
    VS: tl.constexpr = 4 if SRC_KIND == 0 else 8  # elements per 16 bytes
    VD: tl.constexpr = 4 if DST_KIND == 0 else 8
    lo = tl.load(starts_ptr + pid)
    hi = tl.load(starts_ptr + pid + 1)
    row = table_ptr + lo.to(tl.int64) * 4
    src_off = tl.load(row, mask=lo < hi, other=0)
    dst_off = tl.load(row + 1, mask=lo < hi, other=0)
    flags = tl.load(row + 2, mask=lo < hi, other=0)
    n = tl.load(row + 3, mask=lo < hi, other=0)
    for r in range(lo, hi):
        nxt_src_off, nxt_dst_off, nxt_flags, nxt_n = _next_row(table_ptr, r, hi)
        n_src = tl.where((flags & 1) != 0, n, 0)  # elements to read; None rows read none and store zeros
        n_full = n_src - n_src % BLOCK
        src_al = (flags & 2) != 0
        dst_al = (flags & 4) != 0
        ctr_base = src_off + rng_offset
        if src_al & dst_al:
            acc_sq, acc_bad = _copy_tiles(
                src_base_ptr + _aligned_off(src_off, VS), dst_base_ptr + _aligned_off(dst_off, VD), n_full,
                lane, ctr_base, k0, k1, acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, BLOCK,
            )  # fmt: skip
        elif src_al:
            acc_sq, acc_bad = _copy_tiles(
                src_base_ptr + _aligned_off(src_off, VS), dst_base_ptr + dst_off, n_full,
                lane, ctr_base, k0, k1, acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, BLOCK,
            )  # fmt: skip
        elif dst_al:
            acc_sq, acc_bad = _copy_tiles(
                src_base_ptr + src_off, dst_base_ptr + _aligned_off(dst_off, VD), n_full,
                lane, ctr_base, k0, k1, acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, BLOCK,
            )  # fmt: skip
        else:
            acc_sq, acc_bad = _copy_tiles(
                src_base_ptr + src_off, dst_base_ptr + dst_off, n_full,
                lane, ctr_base, k0, k1, acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, BLOCK,
            )  # fmt: skip
        src = src_base_ptr + src_off
        dst = dst_base_ptr + dst_off
        for start in range(n_full, n, BLOCK):  # the tail (and None rows)
            offs = start + lane
            # NOTE: written out, not through _sload / _sstore: through the helpers Triton 3.6 compiled
            # p8/b1024/w4 bf16 to 56 registers with spills instead of 64 without (offline sm_90, 2026-11-30).
            if STREAM:
                x = tl.load(src + offs, mask=offs < n_src, other=0, eviction_policy="evict_first")
            else:
                x = tl.load(src + offs, mask=offs < n_src, other=0)
            y = _convert(x, ctr_base + offs, k0, k1, SRC_KIND, DST_KIND, STOCHASTIC)
            if STREAM:
                tl.store(dst + offs, y, mask=offs < n, cache_modifier=".cs")
            else:
                tl.store(dst + offs, y, mask=offs < n)
            if STATS:
                v = _to_f32(y, DST_KIND)  # masked lanes loaded 0 -> contribute 0
                acc_sq += v * v
                acc_bad += _nonfinite(v)
        src_off = nxt_src_off
        dst_off = nxt_dst_off
        flags = nxt_flags
        n = nxt_n
    if STATS:
        _publish_stats(acc_sq, acc_bad, part_sq_ptr, part_bad_ptr, part_base, counter_ptr, stats_ptr, pid, n_prog,
                       old_sq, old_bad, ONE_PASS, BLOCK, EPI_W, EPI_CNT64, SPREAD)


# ---------------------------------------------------- rows, kernel 2: 2-D tiles, small accumulators


@triton.jit
def _row_sums(v, AXIS: tl.constexpr):
    """Per-slot sums of squares and non-finite counts of the fp32 tile ``v`` along ``AXIS`` (within a
    thread for the layouts :func:`_rows2_kernel` uses)."""
    return tl.sum(v * v, axis=AXIS), tl.sum(_nonfinite(v), axis=AXIS)


@triton.jit
def _word_sums(w):
    """Sums of squares and exact non-finite counts of ``[R, 4]`` int32 words, each two bf16 (low, high),
    along axis 1, on the packed bits.

    bf16 -> fp32 of the high half is ``w & 0xFFFF0000``, of the low half ``w << 16``. Non-finite means an
    all-ones exponent (``0x7F80`` in a half): ``(w & 0x7F807F80) + 0x00800080`` carries into bit 15 (31) of
    exactly those halves and never across halves (``0x7F80 + 0x80 = 0x8000``); the bits shifted down to 0
    and 16 sum over the row's 4 words without overflowing 16 bits, then the two halves are added.
    """
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000 as an int32
    sq = tl.sum(lo * lo + hi * hi, axis=1)
    t = ((w & 0x7F807F80) + 0x00800080) >> 15
    pair = tl.sum(t & 0x00010001, axis=1)
    return sq, (pair & 0xFFFF) + (pair >> 16)


@triton.jit
def _vec_tile(
    src, dst, offs, mask, ctr, k0, k1, acc_sq, acc_bad,
    SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, MASKED: tl.constexpr,
):  # fmt: skip
    """One ``[R, VW]`` tile at ``src`` / ``dst`` of a row aligned on both sides (``offs``: int32 element
    offsets, VW contiguous per tile row, so every access is a whole vector); ``mask`` is ``[R, 1]``, per
    tile row, when MASKED. ``ctr``: the stochastic-rounding counter of the tile's first element."""
    y = _convert(_sload(src + offs, mask, MASKED, STREAM), ctr + offs, k0, k1, SRC_KIND, DST_KIND, STOCHASTIC)
    _sstore(dst + offs, y, mask, MASKED, STREAM)
    if STATS:
        s, c = _row_sums(_to_f32(y, DST_KIND), 1)
        acc_sq += s
        acc_bad += c
    return acc_sq, acc_bad


@triton.jit
def _cols(w):
    """The 4 columns of an ``[R, 4]`` int32 tile as ``[R]`` tensors (register renaming within a thread)."""
    e0, e1 = tl.split(tl.reshape(w, [w.shape[0], 2, 2]))  # (w0, w2), (w1, w3)
    w0, w2 = tl.split(e0)
    w1, w3 = tl.split(e1)
    return w0, w1, w2, w3


@triton.jit
def _pick(w0, w1, w2, w3, w4, w5, w6, w7, K: tl.constexpr):
    """Word ``K`` (a constexpr) of eight."""
    if K == 0:  # noqa: SIM116 (a dict of tensors does not compile in a Triton kernel)
        return w0
    elif K == 1:
        return w1
    elif K == 2:
        return w2
    elif K == 3:
        return w3
    elif K == 4:
        return w4
    elif K == 5:
        return w5
    elif K == 6:
        return w6
    else:
        return w7


@triton.jit
def _halves(w0, w1, w2, w3, w4, w5, w6, w7, H: tl.constexpr):
    """The int32 word made of bf16 halves ``H`` (low) and ``H + 1`` (high) of the 16 halves in words
    ``w0..w7`` (half ``2 i`` is the low half of word ``i``): a word of its own when ``H`` is even, else the
    high half of one word and the low half of the next."""
    if H % 2 == 0:
        return _pick(w0, w1, w2, w3, w4, w5, w6, w7, H // 2)
    else:
        lo = _pick(w0, w1, w2, w3, w4, w5, w6, w7, H // 2)
        hi = _pick(w0, w1, w2, w3, w4, w5, w6, w7, H // 2 + 1)
        return ((lo >> 16) & 0xFFFF) | (hi << 16)


@triton.jit
def _shift_words(a, b, D: tl.constexpr):
    """``[R, 4]`` words holding bf16 halves ``D .. D + 7`` of each row's 16 halves ``a ++ b`` (D in 1..7)."""
    a0, a1, a2, a3 = _cols(a)
    b0, b1, b2, b3 = _cols(b)
    o0 = _halves(a0, a1, a2, a3, b0, b1, b2, b3, D)
    o1 = _halves(a0, a1, a2, a3, b0, b1, b2, b3, D + 2)
    o2 = _halves(a0, a1, a2, a3, b0, b1, b2, b3, D + 4)
    o3 = _halves(a0, a1, a2, a3, b0, b1, b2, b3, D + 6)
    return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [a.shape[0], 4])


@triton.jit
def _word_load(src, offs, mask, STREAM, MASKED: tl.constexpr, D: tl.constexpr):
    """The words of one ``[R, 4]`` tile of a bf16 -> bf16 row whose destination is on a 16-byte boundary and
    whose source is ``D`` halves (0..7) past one. ``D = 0``: the source words as they are. ``D > 0``
    (``RowsConfig.realign``): destination vector row ``r`` is halves ``D .. D + 7`` of source vectors ``r`` and
    ``r + 1``, two aligned 16-byte loads (the second is the next row's first: an L1 hit, no extra DRAM
    traffic)."""
    a = _sload(src + offs, mask, MASKED, STREAM)
    if D == 0:
        w = a
    else:
        b = _sload(src + 4 + offs, mask, MASKED, STREAM)
        w = _shift_words(a, b, D)
    return w


@triton.jit
def _word_put(dst, offs, w, mask, acc_sq, acc_bad, STATS, STREAM, MASKED: tl.constexpr):
    """Store a tile of :func:`_word_load` (one aligned 16-byte store per vector row) and add its statistics."""
    _sstore(dst + offs, w, mask, MASKED, STREAM)
    if STATS:
        s, c = _word_sums(w)
        acc_sq += s
        acc_bad += c
    return acc_sq, acc_bad


@triton.jit
def _word_tile(src, dst, offs, mask, acc_sq, acc_bad, STATS, STREAM, MASKED: tl.constexpr, D: tl.constexpr):
    """One tile: :func:`_word_load` then :func:`_word_put`."""
    w = _word_load(src, offs, mask, STREAM, MASKED, D)
    return _word_put(dst, offs, w, mask, acc_sq, acc_bad, STATS, STREAM, MASKED)


@triton.jit
def _word_rows(src_w, dst_w, nve, vec_rows, word_offs, acc_sq, acc_bad, STATS, STREAM, BLOCK: tl.constexpr,
               D: tl.constexpr, LOOKAHEAD: tl.constexpr):
    """``nve`` elements (whole vectors) of a bf16 -> bf16 row as word tiles (:func:`_word_tile`): whole tiles
    unmasked, then one tile masked per vector row. ``src_w`` / ``dst_w``: int32 pointers at 16-byte
    boundaries. LOOKAHEAD (``RowsConfig.lookahead``): the loads of whole tile ``i + 1`` are issued before the
    store and statistics of tile ``i`` (source and destination never overlap), so a warp does not wait for
    its next loads behind the current tile's ~85 instructions."""
    n_full = (nve // BLOCK) * BLOCK
    if LOOKAHEAD:
        if n_full > 0:
            w = _word_load(src_w, word_offs, None, STREAM, False, D)
            for start in range(BLOCK, n_full, BLOCK):
                ahead = _word_load(src_w + start // 2, word_offs, None, STREAM, False, D)
                acc_sq, acc_bad = _word_put(dst_w + (start - BLOCK) // 2, word_offs, w, None, acc_sq, acc_bad, STATS,
                                            STREAM, False)
                w = ahead
            acc_sq, acc_bad = _word_put(dst_w + (n_full - BLOCK) // 2, word_offs, w, None, acc_sq, acc_bad, STATS,
                                        STREAM, False)
    else:
        for start in range(0, n_full, BLOCK):
            acc_sq, acc_bad = _word_tile(
                src_w + start // 2, dst_w + start // 2, word_offs, None, acc_sq, acc_bad, STATS, STREAM, False, D
            )
    if n_full < nve:
        acc_sq, acc_bad = _word_tile(
            src_w + n_full // 2, dst_w + n_full // 2, word_offs, vec_rows < (nve - n_full).to(tl.int32),
            acc_sq, acc_bad, STATS, STREAM, True, D,
        )  # fmt: skip
    return acc_sq, acc_bad


@triton.jit
def _scalar_tile(
    src, dst, offs, rem_src, rem, ctr, k0, k1, acc_sq, acc_bad,
    SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, MASKED: tl.constexpr,
):  # fmt: skip
    """One ``[8, R]`` tile element by element (``offs``: column ``c`` holds elements ``c, c + R, ...``, so a
    warp's accesses are contiguous and load and store share one layout); when MASKED, loads keep
    ``offs < rem_src`` and stores ``offs < rem`` (int32 counts left in the row from the tile's start)."""
    x = _sload(src + offs, offs < rem_src, MASKED, STREAM)
    y = _convert(x, ctr + offs, k0, k1, SRC_KIND, DST_KIND, STOCHASTIC)
    _sstore(dst + offs, y, offs < rem, MASKED, STREAM)
    if STATS:
        s, c = _row_sums(_to_f32(y, DST_KIND), 0)  # masked-out lanes hold 0: they add nothing
        acc_sq += s
        acc_bad += c
    return acc_sq, acc_bad


@triton.jit(do_not_specialize=["part_base", "k0", "k1", "rng_offset"])
def _rows2_kernel(
    table_ptr,
    heads_ptr,
    src_base_ptr,
    dst_base_ptr,
    part_sq_ptr,
    part_bad_ptr,
    part_base,
    counter_ptr,
    stats_ptr,
    k0,
    k1,
    rng_offset,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    STATS: tl.constexpr,
    ONE_PASS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
    PACKED: tl.constexpr,
    SCALAR_ROWS: tl.constexpr,
    REALIGN: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
    STREAM: tl.constexpr,
    EPI_W: tl.constexpr,
    EPI_CNT64: tl.constexpr,
    SPREAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`_rows_kernel`'s contract (same rows, flags, statistics, counters, reduction), with tiles laid
    out for a read-mostly stream with statistics (``RowsConfig.kernel == 2``; see docs/triton_kernels.md):

    * a tile of BLOCK elements is 2-D: ``[R, VW]`` on rows aligned on both sides, VW = 16 bytes of the
      destination (8 elements; 4 into fp32), so each thread owns whole vectors, BLOCK / (VW * threads) of
      them in flight per iteration; ``[S, R]`` element by element on the other rows (S * R elements, 8 per
      thread: ``SCALAR_ROWS``), one layout for load and store, no shared-memory exchange. Both reduce
      their statistics within the thread into the same ``[R]`` accumulators (R = BLOCK / VW): 2 * R /
      threads registers instead of 2 * BLOCK / threads, so BLOCK can grow (more bytes in flight) without
      costing occupancy;
    * on aligned rows only the last < VW elements go element by element: whole tiles unmasked, then one
      tile masked per vector row (a row-uniform mask keeps the vector accesses);
    * PACKED (bf16 -> bf16): aligned rows move int32 words (two bf16), and the statistics work on the
      packed bits (:func:`_word_sums`);
    * REALIGN (with PACKED, bf16 -> bf16): a row that is not aligned on both sides still moves whole
      16-byte vectors: aligned on the destination, each built from two aligned source vectors shifted by
      the row's phase difference (:func:`_word_tile`); only a head of < 16 elements and a tail of < 24
      go element by element. With an fp32 side (no words): whole tiles aligned on the destination, the
      source read element by element in the tile's layout (a head of < 8 elements first);
    * LOOKAHEAD (with PACKED): the word tiles' loads run one whole tile ahead of their stores (:func:`_word_rows`);
    * program ``pid``'s first row comes with its row range in one record ``heads[pid] = [lo, hi, src_off,
      dst_off, flags, n, 0, 0]``: one dependent load fewer before the first tile;
    * ONE_PASS: the last program loads ``stats`` together with the partials; SPREAD as in kernel 1.

    Statistics are deterministic for a given config (fixed rows per program, fixed order everywhere); the
    order of the fp32 additions differs from :func:`_rows_kernel`'s. PDL: see :func:`_dependent_launch`.
    """
    _dependent_launch(PDL)
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    # Elements per row of a vector tile: 16 bytes of the destination (Triton stores at most 16 bytes per
    # thread and access; loads of an fp32 source take two).
    VW: tl.constexpr = 4 if DST_KIND == 0 else 8
    R: tl.constexpr = BLOCK // VW
    VS: tl.constexpr = 4 if SRC_KIND == 0 else 8  # elements per 16 bytes
    VD: tl.constexpr = 4 if DST_KIND == 0 else 8
    WORDS: tl.constexpr = PACKED and SRC_KIND == 1 and DST_KIND == 1
    SHIFTED: tl.constexpr = REALIGN and WORDS
    S: tl.constexpr = SCALAR_ROWS  # element-by-element tiles are [S, R]: S * R elements
    r_idx = tl.arange(0, R)
    vec_rows = r_idx[:, None] * VW  # [R, 1]: first element of each row of a vector tile
    vec_offs = vec_rows + tl.arange(0, VW)[None, :]  # [R, VW]
    word_offs = r_idx[:, None] * 4 + tl.arange(0, 4)[None, :]  # [R, 4] int32 words = the same bytes
    sca_offs = tl.arange(0, S)[:, None] * R + r_idx[None, :]  # [S, R]
    acc_sq = tl.zeros([R], dtype=tl.float32)
    acc_bad = tl.zeros([R], dtype=tl.int32)
    old_sq, old_bad = _spread_row(stats_ptr, part_base, pid, SPREAD)
    head = heads_ptr + pid.to(tl.int64) * 8
    lo = tl.load(head).to(tl.int32)
    hi = tl.load(head + 1).to(tl.int32)
    src_off = tl.load(head + 2)
    dst_off = tl.load(head + 3)
    flags = tl.load(head + 4)
    n = tl.load(head + 5)
    for r in range(lo, hi):
        nxt_src_off, nxt_dst_off, nxt_flags, nxt_n = _next_row(table_ptr, r, hi)
        n_src = tl.where((flags & 1) != 0, n, 0)
        both_al = (flags & 6) == 6
        n8 = tl.where(both_al, (n_src // VW) * VW, 0)  # elements that go through whole vector rows
        ctr_base = src_off + rng_offset
        if n8 > 0:
            n_full = (n8 // BLOCK) * BLOCK
            src_v = src_base_ptr + _aligned_off(src_off, VS)
            dst_v = dst_base_ptr + _aligned_off(dst_off, VD)
            if WORDS:
                src_w = src_v.to(tl.pointer_type(tl.int32), bitcast=True)
                dst_w = dst_v.to(tl.pointer_type(tl.int32), bitcast=True)
                acc_sq, acc_bad = _word_rows(src_w, dst_w, n8, vec_rows, word_offs, acc_sq, acc_bad, STATS, STREAM,
                                             BLOCK, 0, LOOKAHEAD)
            else:
                for start in range(0, n_full, BLOCK):
                    acc_sq, acc_bad = _vec_tile(
                        src_v + start, dst_v + start, vec_offs, None, ctr_base + start, k0, k1, acc_sq, acc_bad,
                        SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, False,
                    )  # fmt: skip
                if n_full < n8:
                    acc_sq, acc_bad = _vec_tile(
                        src_v + n_full, dst_v + n_full, vec_offs, vec_rows < (n8 - n_full).to(tl.int32),
                        ctr_base + n_full, k0, k1, acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, True,
                    )  # fmt: skip
        # Element by element: whole tiles of rows not aligned on both sides, then every row's rest (the
        # last < VW elements of an aligned row; all of a row without a source, which stores zeros).
        src = src_base_ptr + src_off
        dst = dst_base_ptr + dst_off
        if SHIFTED:
            # Rows not aligned on both sides, in row-relative elements: source vectors start at hs, the
            # destination's at hd; destination vector j0 + 8 m (j0 = hs + d) is halves d .. d + 7 of source
            # vectors hs + 8 m and hs + 8 (m + 1), all inside the row; [0, j0) and [j0 + 8 nv, n) go
            # element by element (head here, the rest below).
            hs = ((-src_off) & 7).to(tl.int32)  # offsets count from 16-byte-aligned bases
            d = (((-dst_off) & 7).to(tl.int32) - hs) & 7
            j0 = hs + d
            nv = tl.where(both_al, 0, tl.maximum(n_src - hs - 8, 0) // 8)
            e0 = tl.where(both_al, n8, 0)
            if nv > 0:
                acc_sq, acc_bad = _scalar_tile(
                    src, dst, sca_offs, j0, j0, ctr_base, k0, k1, acc_sq, acc_bad,
                    SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, True,
                )  # fmt: skip
                src_w = (src_base_ptr + _aligned_off(src_off + hs, VS)).to(tl.pointer_type(tl.int32), bitcast=True)
                dst_w = (dst_base_ptr + _aligned_off(dst_off + j0, VD)).to(tl.pointer_type(tl.int32), bitcast=True)
                nve = nv * 8
                for k in tl.static_range(0, 8):  # one loop per phase difference (0: the same phase on both
                    if d == k:                    # sides, a bit copy): the shift must be a constexpr
                        acc_sq, acc_bad = _word_rows(src_w, dst_w, nve, vec_rows, word_offs, acc_sq, acc_bad, STATS,
                                                     STREAM, BLOCK, k, LOOKAHEAD)
                e0 = (j0 + nve).to(e0.dtype)
            s_full = e0 + ((n_src - e0) // (S * R)) * (S * R)
        elif REALIGN:
            # An fp32 side (no words): rows not aligned on both sides move whole [R, VW] tiles aligned on the
            # destination (one 16-byte store per vector row) with the source read element by element in the
            # same layout (scalar loads, each thread's 16-32 bytes contiguous); a head of < VD elements first,
            # the rest below.
            hd = ((-dst_off) & (VD - 1)).to(tl.int32)
            nt = tl.where(both_al, 0, tl.maximum(n_src - hd, 0) // BLOCK)
            e0 = tl.where(both_al, n8, 0)
            if nt > 0:
                acc_sq, acc_bad = _scalar_tile(
                    src, dst, sca_offs, hd, hd, ctr_base, k0, k1, acc_sq, acc_bad,
                    SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, True,
                )  # fmt: skip
                dst_v = dst_base_ptr + _aligned_off(dst_off + hd, VD)
                for start in range(0, nt * BLOCK, BLOCK):
                    acc_sq, acc_bad = _vec_tile(
                        src + hd + start, dst_v + start, vec_offs, None, ctr_base + hd + start, k0, k1, acc_sq,
                        acc_bad, SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, False,
                    )  # fmt: skip
                e0 = (hd + nt * BLOCK).to(e0.dtype)
            s_full = e0 + ((n_src - e0) // (S * R)) * (S * R)
        else:
            e0 = n8
            s_full = tl.where(both_al, n8, (n_src // (S * R)) * (S * R))
        for start in range(e0, s_full, S * R):
            acc_sq, acc_bad = _scalar_tile(
                src + start, dst + start, sca_offs, 0, 0, ctr_base + start, k0, k1, acc_sq, acc_bad,
                SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, False,
            )  # fmt: skip
        for start in range(s_full, n, S * R):
            rem_src = tl.minimum(tl.maximum(n_src - start, 0), S * R).to(tl.int32)
            rem = tl.minimum(n - start, S * R).to(tl.int32)
            acc_sq, acc_bad = _scalar_tile(
                src + start, dst + start, sca_offs, rem_src, rem, ctr_base + start, k0, k1, acc_sq, acc_bad,
                SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, True,
            )  # fmt: skip
        src_off = nxt_src_off
        dst_off = nxt_dst_off
        flags = nxt_flags
        n = nxt_n
    if STATS:
        _publish_stats(acc_sq, acc_bad, part_sq_ptr, part_bad_ptr, part_base, counter_ptr, stats_ptr, pid, n_prog,
                       old_sq, old_bad, ONE_PASS, R, EPI_W, EPI_CNT64, SPREAD)


# ------------------------------------------------------------------ kernel 3: the rows as arguments


@triton.jit
def _entry_tile(
    src, dst, lane, rem, ctr, k0, k1,
    SRC_KIND, DST_KIND, STATS, STOCHASTIC, STREAM, WORDS: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One tile of kernel 3 at ``src`` / ``dst`` (16-byte aligned when not MASKED); ``rem``: elements left in
    the row from here (MASKED). WORDS (bf16 -> bf16, unmasked): int32 words of two bf16, statistics on the
    packed bits. Returns the tile's (sum of squares, non-finite count) of what it stored, in one reduction."""
    if WORDS:
        w = _sload(src.to(tl.pointer_type(tl.int32), bitcast=True) + lane, None, False, STREAM)
        _sstore(dst.to(tl.pointer_type(tl.int32), bitcast=True) + lane, w, None, False, STREAM)
        if STATS:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000 as an int32
            pair = (((w & 0x7F807F80) + 0x00800080) >> 15) & 0x00010001  # see _word_sums
            return _sum_pair(lo * lo + hi * hi, (pair & 0xFFFF) + (pair >> 16))
        else:
            return 0.0, 0
    else:
        mask = lane < rem
        y = _convert(_sload(src + lane, mask, MASKED, STREAM), ctr + lane, k0, k1, SRC_KIND, DST_KIND, STOCHASTIC)
        _sstore(dst + lane, y, mask, MASKED, STREAM)
        if STATS:  # masked-out lanes loaded 0: they add nothing
            v = _to_f32(y, DST_KIND)
            return _sum_pair(v * v, _nonfinite(v))
        else:
            return 0.0, 0


@triton.jit(
    do_not_specialize=["part_base", "k0", "k1", "rng_offset"]
    + [f"{c}{k}" for c in "sdnt" for k in range(8)]
)
def _entries_kernel(
    src_base_ptr, dst_base_ptr, stats_ptr, part_base, k0, k1, rng_offset,
    s0, s1, s2, s3, s4, s5, s6, s7,
    d0, d1, d2, d3, d4, d5, d6, d7,
    n0, n1, n2, n3, n4, n5, n6, n7,
    t0, t1, t2, t3, t4, t5, t6, t7,
    SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr, STATS: tl.constexpr, STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, PACKED: tl.constexpr, STREAM: tl.constexpr, SPREAD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Kernel 3 (``RowsConfig.kernel == 3``): the rows of a launch of at most ``ENTRY_SLOTS`` rows, each 16-byte
    aligned on both sides, given as scalar arguments instead of a work table, so that no program waits for a
    dependent load before its first data load (docs/triton_kernels.md, "Rows as arguments").

    Row ``k``: source / destination element offsets ``s_k - _ARG_BIAS`` / ``d_k - _ARG_BIAS`` (biased so that
    every launch passes them as int64: one compiled variant), ``n_k`` elements, programs ``[t_k, t_{k+1})``
    (``t_0 = 0``; unused slots: ``t_k`` = 2**31 - 1). Program ``pid`` takes elements ``[i * CHUNK, (i + 1) *
    CHUNK)`` of its row, ``i = pid - t_k``, in BLOCK-element tiles: whole tiles unmasked (16-byte vectors;
    bf16 -> bf16 with PACKED as int32 words), the row's last tile masked. Statistics only spread (SPREAD, which
    implies STATS): each program adds its (sum of squares, non-finite count) to row ``part_base + pid`` of
    ``stats``. PDL: see :func:`_dependent_launch`."""
    _dependent_launch(PDL)
    pid = tl.program_id(0)
    old_sq, old_bad = _spread_row(stats_ptr, part_base, pid, SPREAD)
    so = s0
    do = d0
    n = n0
    first = t0
    for k in tl.static_range(1, 8):
        tk = _pick(t0, t1, t2, t3, t4, t5, t6, t7, k)
        sel = pid >= tk
        so = tl.where(sel, _pick(s0, s1, s2, s3, s4, s5, s6, s7, k), so)
        do = tl.where(sel, _pick(d0, d1, d2, d3, d4, d5, d6, d7, k), do)
        n = tl.where(sel, _pick(n0, n1, n2, n3, n4, n5, n6, n7, k), n)
        first = tl.where(sel, tk, first)
    VS: tl.constexpr = 4 if SRC_KIND == 0 else 8  # elements per 16 bytes
    VD: tl.constexpr = 4 if DST_KIND == 0 else 8
    WORDS: tl.constexpr = PACKED and SRC_KIND == 1 and DST_KIND == 1
    src_off = _aligned_off(so - _ARG_BIAS, VS)
    dst_off = _aligned_off(do - _ARG_BIAS, VD)
    start = (pid - first).to(tl.int64) * CHUNK
    src = src_base_ptr + src_off + start
    dst = dst_base_ptr + dst_off + start
    ctr = src_off + rng_offset + start
    lane = tl.arange(0, BLOCK)
    lane_w = tl.arange(0, BLOCK // 2)
    sq = 0.0
    bad = 0
    for t in tl.static_range(0, CHUNK, BLOCK):
        rem = n - start - t  # elements of the row from this tile on (may be <= 0: past the row's end)
        if rem >= BLOCK:
            if WORDS:
                s, c = _entry_tile(src + t, dst + t, lane_w, rem, ctr + t, k0, k1, SRC_KIND, DST_KIND, STATS,
                                   STOCHASTIC, STREAM, True, False)  # fmt: skip
            else:
                s, c = _entry_tile(src + t, dst + t, lane, rem, ctr + t, k0, k1, SRC_KIND, DST_KIND, STATS,
                                   STOCHASTIC, STREAM, False, False)  # fmt: skip
            sq += s
            bad += c
        elif rem > 0:
            s, c = _entry_tile(src + t, dst + t, lane, rem.to(tl.int32), ctr + t, k0, k1, SRC_KIND, DST_KIND,
                               STATS, STOCHASTIC, STREAM, False, True)  # fmt: skip
            sq += s
            bad += c
    if SPREAD:
        row = stats_ptr + (part_base + pid).to(tl.int64) * 2
        tl.store(row, old_sq + sq)
        tl.store(row + 1, old_bad + bad.to(tl.float32))


@triton.jit
def _stats_finalize_kernel(part_sq_ptr, part_bad_ptr, n_parts, stats_ptr, BLOCK: tl.constexpr):
    """Single program: ``stats += [sum(part_sq), sum(part_bad)]`` (deterministic, no atomics)."""
    lane = tl.arange(0, BLOCK)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    acc_bad = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n_parts, BLOCK):
        offs = start + lane
        m = offs < n_parts
        acc_sq += tl.load(part_sq_ptr + offs, mask=m, other=0.0)
        acc_bad += tl.load(part_bad_ptr + offs, mask=m, other=0).to(tl.int64)
    s = tl.sum(acc_sq, axis=0)
    c = tl.sum(acc_bad, axis=0)
    tl.store(stats_ptr, tl.load(stats_ptr) + s)
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + c.to(tl.float32))


# NOTE: the two-pass finalize reads 8 bytes per program of the main pass (a few KiB); one program suffices.
_FINALIZE_BLOCK = 1024


def _stream_key(device: torch.device) -> int:
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


def _storage_start(t: torch.Tensor) -> torch.Tensor:
    """A one-element view of ``t``'s storage at offset 0 (an allocation start: 16-byte aligned in practice).

    The bucket tensors are addressed from there, so a bucket that is a view at an odd offset of a larger
    buffer keeps 16-byte vector access on every row whose absolute address is aligned.
    """
    return t.as_strided((1,), (1,), 0)


def _pick_base(addrs: np.ndarray) -> int:
    """Index of the base tensor of a group: the first 16-byte-aligned address, else the first."""
    al = np.flatnonzero(addrs % 16 == 0)
    return int(al[0]) if len(al) else 0


def _upload(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """A work table to the device: pinned + non_blocking on CUDA (ordered on the current stream, no host
    sync; the caching host allocator keeps the pinned block alive until the copy has run)."""
    host = torch.from_numpy(np.ascontiguousarray(rows))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _configs_for(family: str, numel: int) -> tuple[RowsConfig, RowsConfig]:
    """The launch's config and the one for rows kernel 3 cannot run (the same unless the first is kernel 3)."""
    return _config(family, numel), _config(family, numel, kernel3=False)


def _config(family: str, numel: int, *, kernel3: bool = True) -> RowsConfig:
    """The launch config: the table's (or a forced one; ``kernel3``: see :func:`._configs.choose`); under the
    interpreter the table's tiles are widened (see :func:`_tile`) while forced configs run exactly as given,
    so tests can cover each one."""
    cfg = _configs.choose(family, numel, kernel3=kernel3)
    if mode() == "interpreter" and not (_configs.is_forced(family) and cfg == _configs.choose(family, numel)):
        block = _tile(cfg.block)
        chunk = max(cfg.chunk, 4 * block) if cfg.chunk else 0
        cfg = dataclasses.replace(cfg, block=block, chunk=chunk)
    return cfg


_resident: dict[tuple[Any, ...], int] = {}
_resident_lock = threading.Lock()
# Registers, spills, shared memory and programs per SM of each compiled row-kernel variant (for benchmarks).
occupancy: dict[tuple[Any, ...], dict[str, Any]] = {}
_dummies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small allocation of ``dtype`` (16-byte aligned like every real one) for compile-only calls."""
    t = _dummies.get((device, dtype))
    if t is None:
        t = _dummies[(device, dtype)] = torch.zeros(8, dtype=dtype, device=device)
    return t


def _meta(
    cfg: RowsConfig,
    src_kind: int,
    dst_kind: int,
    stats: bool,
    stochastic: bool,
    spread: bool = False,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """The row kernel's constexprs for this config and dtype pair (kernel 2 also takes PACKED); ``spread``:
    the statistics go into one row of ``stats`` per program (no reduction in the launch). PDL holds only where
    a dependent launch exists: compiled (not the interpreter), on an sm_90+ ``device``."""
    spread = spread and stats
    pdl = cfg.pdl and device is not None and _pdl_capable(device)
    if cfg.kernel == 3:
        return dict(
            SRC_KIND=src_kind, DST_KIND=dst_kind, STATS=stats, STOCHASTIC=stochastic, BLOCK=cfg.block,
            CHUNK=cfg.chunk, PACKED=cfg.packed, STREAM=cfg.stream, SPREAD=spread,
            PDL=pdl,
        )  # fmt: skip
    one_pass = cfg.one_pass and stats and not spread
    meta = dict(
        SRC_KIND=src_kind, DST_KIND=dst_kind, STATS=stats, ONE_PASS=one_pass, STOCHASTIC=stochastic, BLOCK=cfg.block,
    )  # fmt: skip
    if cfg.kernel == 2:
        meta["PACKED"] = cfg.packed
        meta["SCALAR_ROWS"] = _scalar_rows(cfg, dst_kind)
        meta["REALIGN"] = cfg.realign
        meta["LOOKAHEAD"] = cfg.lookahead
    # NOTE: in the kernels' parameter order (benchmarks/triton_offline_sass.py maps constexprs by position).
    meta["STREAM"] = cfg.stream
    # the widest variant; _launch_rows narrows EPI_W to the launch's grid
    meta["EPI_W"] = _EPI_MAX * cfg.warps if one_pass and cfg.epilogue != "loop" else 0
    meta["EPI_CNT64"] = True
    meta["SPREAD"] = spread
    meta["PDL"] = pdl
    return meta


# A launch of fewer elements than this sums its per-program non-finite counts in int32 in the wide epilogue.
_CNT32_LIMIT = 2**31
# NOTE: the wide epilogue's widest chunk, in partials per warp: 128 = 4 fp32 + 4 int32 per thread. Compiled
# offline for sm_90 (benchmarks/triton_offline_sass.py, Triton 3.9), kernel 2 packed b2048/b4096 on 4 warps
# keeps its 40 registers (12 programs per SM) up to 512 lanes and takes 50-55 at 1024, 80-90 at 2048: a
# wider chunk would cost the whole kernel occupancy. A 1056-program grid (132 SMs x 8) is 3 chunks of 512
# (the loop at kernel 2's b2048 accumulator width: 5 of 256).
_EPI_MAX = 128


def _epilogue_meta(meta: dict[str, Any], grid: int, total: int) -> dict[str, Any]:
    """``meta`` with the wide epilogue sized to this launch: chunks of the next power of two >= the partials to
    add (``grid``), at least 16 and at most the variant's width, and int64 counts only for a launch of 2**31
    elements or more."""
    if not meta.get("EPI_W"):
        return meta
    width = min(meta["EPI_W"], max(16, triton.next_power_of_2(grid)))
    return {**meta, "EPI_W": width, "EPI_CNT64": total >= _CNT32_LIMIT}


def _scalar_rows(cfg: RowsConfig, dst_kind: int) -> int:
    """Rows S of kernel 2's element-by-element tiles ``[S, R]`` (R = block / VW, VW = 4 elements into fp32,
    else 8): 8 elements per thread, ``S = 8 * 32 * warps / R``, within 1..8.

    NOTE: compiled for sm_90 with Triton 3.6 (offline, ptxas), a 4-warp bf16 statistics variant takes 40-45
    registers with 8 elements per thread in these tiles, ~96 with 16 and ~168 with 32 (b4096 with S = 8):
    the element path would cap the occupancy of the whole kernel, vector path included.
    """
    vw = 4 if dst_kind == 0 else 8
    return max(1, min(8, 256 * cfg.warps * vw // cfg.block))


def _rows_fn(cfg: RowsConfig) -> Any:
    """The row kernel that runs ``cfg``."""
    return {1: _rows_kernel, 2: _rows2_kernel, 3: _entries_kernel}[cfg.kernel]


_STORAGE = {0: torch.float32, 1: torch.int16, 2: torch.float16}


@dataclasses.dataclass(frozen=True)
class _Work:
    """One launch: the config that runs it and its constexprs, the grid and element count, and the rows: a
    work table with per-program starts (kernel 1) or heads (kernel 2) on the device, or kernel 3's scalar
    arguments."""

    cfg: RowsConfig
    meta: dict[str, Any]
    grid: int
    total: int
    table: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    args: tuple[int, ...] = ()


def _fit_per_sm(cfg: RowsConfig, device: torch.device, meta: dict[str, Any]) -> int:
    """Programs of this row-kernel variant that fit on one SM at once (compiles it, once per variant):
    from its registers and shared memory, by the CUDA occupancy rules. ``programs_per_sm`` itself when that
    cannot be worked out (an older Triton without ``warmup`` / ``n_regs``)."""
    key = (device.index, cfg.kernel, cfg.warps, tuple(sorted(meta.items())))
    fit = _resident.get(key)
    if fit is not None:
        return fit
    fit = cfg.programs_per_sm
    try:
        i64, i32, f32 = (_dummy(device, d) for d in (torch.int64, torch.int32, torch.float32))
        src = _dummy(device, _STORAGE[meta["SRC_KIND"]])
        dst = _dummy(device, _STORAGE[meta["DST_KIND"]])
        heads_or_starts = i64 if cfg.kernel == 2 else i32  # typed as the launch's: the same compiled variant
        compiled = _rows_fn(cfg).warmup(
            i64, heads_or_starts, src, dst, f32, i32, 0, i32, f32, 0, 0, 0, grid=(1,), num_warps=cfg.warps,
            **meta,
        )  # fmt: skip
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        fit = _configs.max_resident_programs(
            warps=cfg.warps,
            regs_per_thread=int(compiled.n_regs),
            shared_bytes=int(compiled.metadata.shared),
            max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 2048)),
            regs_per_sm=int(getattr(props, "regs_per_multiprocessor", 65536)),
            shared_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)),
        )
        occupancy[key] = {
            "kernel": cfg.kernel, "warps": cfg.warps, **meta, "regs": int(compiled.n_regs),
            "spills": int(compiled.n_spills),
            "shared": int(compiled.metadata.shared), "fit_per_sm": fit,
        }  # fmt: skip
    except Exception as e:  # trust the config
        occupancy[key] = {"kernel": cfg.kernel, "warps": cfg.warps, **meta, "error": f"{type(e).__name__}: {e}"}
    with _resident_lock:
        _resident[key] = fit
    return fit


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """Whether launches on ``device`` can be programmatic dependent launches: compiled Triton on a CUDA device
    of compute capability 9.0 or newer (the ``griddepcontrol`` instructions)."""
    return mode() == "native" and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _configs.INTERP_SMS


def _work(
    cfgs: tuple[RowsConfig, RowsConfig],
    src_off: np.ndarray,
    dst_off: np.ndarray,
    numel: np.ndarray,
    flags: np.ndarray,
    device: torch.device,
    kinds: tuple[int, int],
    *,
    stats: bool,
    stochastic: bool = False,
    spread: bool = False,
) -> _Work | None:
    """One launch's work (None if no rows) with ``cfgs[0]``, or ``cfgs[1]`` (the table's choice without kernel
    3) where the first is kernel 3 and these rows do not qualify (:func:`._configs.usable`).

    Kernel 3: the rows as arguments (:func:`_entries_work`). Else one program per ``chunk``-element row, or a
    persistent grid of ``programs_per_sm`` per SM (clamped to the variant's occupancy, to one tile per
    program and to ``min_per_program`` elements per program) with an equal share each: one contiguous run of
    rows, or (``interleave``) pieces dealt round-robin. Kernel 2 takes per-program *heads* instead of the
    starts: ``[lo, hi, first row's 4 columns, 0, 0]`` (int64).
    """
    numel = np.asarray(numel, dtype=np.int64)
    some = numel > 0
    few_aligned = (
        int(some.sum()) <= _configs.ENTRY_SLOTS
        and bool(np.all(flags[some] & _ALL_AL == _ALL_AL))
        and int(numel.max(initial=0)) < 2**31 - 1
    )
    cfg = cfgs[0] if _configs.usable(cfgs[0], few_aligned=few_aligned, stats=stats, spread=spread) else cfgs[1]
    meta = _meta(cfg, kinds[0], kinds[1], stats, stochastic, spread, device)
    total = int(numel.sum())
    if cfg.kernel == 3:
        return _entries_work(cfg, meta, src_off[some], dst_off[some], numel[some])
    if cfg.programs_per_sm == 0:
        rows = chunk_rows(src_off, dst_off, numel, flags, cfg.chunk)
        starts = np.arange(len(rows) + 1, dtype=np.int32)
    else:
        pps = cfg.programs_per_sm
        if device.type == "cuda":
            pps = min(pps, _fit_per_sm(cfg, device, meta))
        grid = max(1, min(_sm_count(device) * pps, -(-total // max(cfg.block, cfg.min_per_program))))
        pieces = max(1, (total // grid) // cfg.interleave) if cfg.interleave else 1
        rows, starts = interleaved_rows(src_off, dst_off, numel, flags, grid, pieces)
    if len(rows) == 0:
        return None
    per_program = _heads(rows, starts) if cfg.kernel == 2 else starts
    return _Work(cfg, meta, len(starts) - 1, total, _upload(rows, device), _upload(per_program, device))


def _entries_work(
    cfg: RowsConfig, meta: dict[str, Any], src_off: np.ndarray, dst_off: np.ndarray, numel: np.ndarray
) -> _Work | None:
    """Kernel 3's arguments for these rows (at most ``ENTRY_SLOTS``, none empty): biased offsets, lengths and
    first programs, unused slots padded (no program reaches them)."""
    tiles = -(-numel // cfg.chunk)
    first = np.cumsum(tiles) - tiles
    grid = int(tiles.sum())
    if grid == 0:
        return None
    pad = _configs.ENTRY_SLOTS - len(numel)
    args = (
        *(int(x) + _ARG_BIAS_HOST for x in src_off), *([_ARG_BIAS_HOST] * pad),
        *(int(x) + _ARG_BIAS_HOST for x in dst_off), *([_ARG_BIAS_HOST] * pad),
        *(int(x) for x in numel), *([0] * pad),
        *(int(x) for x in first), *([2**31 - 1] * pad),
    )  # fmt: skip
    return _Work(cfg, meta, grid, int(numel.sum()), args=args)


def _heads(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Kernel 2's per-program records ``[lo, hi, src_off, dst_off, flags, n, 0, 0]`` (the first row's
    columns; zeros for a program without rows)."""
    lo = starts[:-1].astype(np.int64)
    hi = starts[1:].astype(np.int64)
    heads = np.zeros((len(lo), 8), dtype=np.int64)
    heads[:, 0] = lo
    heads[:, 1] = hi
    some = lo < hi
    heads[some, 2:6] = rows[lo[some]]
    return heads


def _launch_rows(
    work: _Work,
    src_base: torch.Tensor,
    dst_base: torch.Tensor,
    parts: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor] | None,
    keys: tuple[int, int, int],
) -> None:
    """One row-kernel launch. ``parts``: ``(part_sq, part_bad, part_base, counter, stats)`` when the launch
    computes statistics."""
    cfg, grid = work.cfg, work.grid
    if parts is None:  # unused (STATS=False); typed like real ones: the same compiled variant either way
        device = dst_base.device
        part_sq, stats = _dummy(device, torch.float32), _dummy(device, torch.float32)
        part_bad = counter = _dummy(device, torch.int32)
        part_base = 0
    else:
        part_sq, part_bad, part_base, counter, stats = parts
    pdl = {"launch_pdl": True} if work.meta["PDL"] else {}  # the interpreter takes no such option
    if cfg.kernel == 3:
        _entries_kernel[(grid,)](
            src_base, dst_base, stats, part_base, *keys, *work.args, num_warps=cfg.warps, **pdl, **work.meta
        )
        return
    _rows_fn(cfg)[(grid,)](
        work.table, work.starts, src_base, dst_base, part_sq, part_bad, part_base, counter, stats, *keys,
        num_warps=cfg.warps, **pdl, **_epilogue_meta(work.meta, grid, work.total),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ flatten


@dataclasses.dataclass
class _FlattenPlan:
    """Cached per exact call layout: each dtype group's work and base tensor, and the statistics scratch
    (one partial per program and, for ONE_PASS, the ticket counter, zero between launches)."""

    groups: list[tuple[_Work, int]]  # (work, base index or -1)
    part_sq: torch.Tensor | None
    part_bad: torch.Tensor | None
    counter: torch.Tensor | None
    spread: bool = False  # one ``stats`` row per program (all groups' programs fit in its rows)


_flatten_plans = PlanCache()


def launch_flatten(
    grads: list[torch.Tensor | None],
    sizes: list[int],
    out: torch.Tensor,
    stats: torch.Tensor | None,
) -> None:
    """Copy ``grads`` into ``out`` and accumulate stats: one launch per distinct source dtype (+ one
    finalize launch when the config reduces in two passes).

    ``stats`` is float32 ``[2]`` or ``[rows, 2]`` (contiguous); its column sums grow by the statistics. With
    ``rows`` at least the launches' programs, each program adds its partial to its own row and nothing is
    reduced on the device ([Note: spread statistics] in docs/design.md); else the config's reduction adds the
    total to row 0.

    ``grads`` entries must already be contiguous, on ``out``'s device, of a supported dtype, element-aligned
    and of the right size (the public function checks). ``None`` entries are zero-filled by the kernel.
    The launch plan (config, work tables, statistics scratch) is cached by the exact addresses, dtypes and
    sizes, so a repeated call costs one pass over the list plus the launches.
    """
    device = out.device
    want_stats = stats is not None
    # rows to spread the statistics over (0: reduce in the launch, into ``stats``' first row)
    rows = stats.shape[0] if stats is not None and stats.dim() == 2 and stats.shape[0] > 1 else 0
    cfgs = _configs_for("flatten_spread" if rows else "flatten", out.numel())
    key = (
        device,
        _stream_key(device),
        cfgs,
        want_stats,
        rows,
        out.data_ptr(),
        out.storage_offset(),
        out.dtype,
        tuple(sizes),
        tuple((g.data_ptr(), g.dtype) if g is not None else None for g in grads),
    )
    plan: _FlattenPlan | None = _flatten_plans.get(key)
    if plan is None:
        plan = _flatten_plan(cfgs, grads, sizes, out, want_stats, rows)
        _flatten_plans.put(key, plan)
    if not plan.groups:
        return
    out_s = _as_storage(out)
    out_base = _storage_start(out_s)
    part_base = 0
    one_pass = plan.groups[0][0].cfg.one_pass  # without spreading every group runs the same (rows) config
    for work, base_idx in plan.groups:
        base = out_s if base_idx < 0 else _as_storage(grads[base_idx])  # type: ignore[arg-type]
        parts = None
        if stats is not None and plan.spread:
            parts = (_dummy(device, torch.float32), _dummy(device, torch.int32), part_base,
                     _dummy(device, torch.int32), stats)  # fmt: skip
        elif stats is not None:
            assert plan.part_sq is not None and plan.part_bad is not None and plan.counter is not None
            parts = (plan.part_sq, plan.part_bad, 0 if one_pass else part_base, plan.counter, stats)
        _launch_rows(work, base, out_base, parts, (0, 0, 0))
        part_base += work.grid
    if stats is not None and not one_pass and not plan.spread:
        _stats_finalize_kernel[(1,)](
            plan.part_sq, plan.part_bad, part_base, stats, BLOCK=_FINALIZE_BLOCK, num_warps=4
        )


def _flatten_plan(
    cfgs: tuple[RowsConfig, RowsConfig], grads: list[torch.Tensor | None], sizes: list[int], out: torch.Tensor,
    want_stats: bool, rows: int,
) -> _FlattenPlan:
    """Group by source dtype, build each group's device work, and the statistics scratch. Spread statistics
    when ``stats`` has ``rows`` >= the programs of all groups (the grid depends on the compiled variant's
    occupancy, so the groups are built for the spread variant first)."""
    spread = want_stats and rows > 0  # rows: 0 or more than one
    groups = _flatten_groups(cfgs, grads, sizes, out, want_stats, spread)
    if spread and sum(w.grid for w, _ in groups) > rows:
        spread = False
        groups = _flatten_groups(cfgs, grads, sizes, out, want_stats, spread)
    device = out.device
    part_sq = part_bad = counter = None
    if want_stats and groups and not spread:
        grids = [w.grid for w, _ in groups]
        n_parts = max(grids) if groups[0][0].cfg.one_pass else sum(grids)
        part_sq = torch.empty(n_parts, dtype=torch.float32, device=device)
        part_bad = torch.empty(n_parts, dtype=torch.int32, device=device)
        counter = torch.zeros(1, dtype=torch.int32, device=device)
    return _FlattenPlan(groups, part_sq, part_bad, counter, spread)


def _flatten_groups(
    cfgs: tuple[RowsConfig, RowsConfig], grads: list[torch.Tensor | None], sizes: list[int], out: torch.Tensor,
    want_stats: bool, spread: bool,
) -> list[tuple[_Work, int]]:
    """One ``(work, base index or -1)`` per source dtype."""
    device = out.device
    dst_kind, dst_es = _KIND[out.dtype]
    sizes_np = np.asarray(sizes, dtype=np.int64)
    flat_off = np.cumsum(sizes_np) - sizes_np
    # Group entries by source dtype; None entries ride along in the out-dtype group (or the first group).
    by_dtype: dict[torch.dtype, list[int]] = {}
    nones: list[int] = []
    for i, g in enumerate(grads):
        if g is None:
            nones.append(i)
        else:
            by_dtype.setdefault(g.dtype, []).append(i)
    if nones:
        host = out.dtype if (out.dtype in by_dtype or not by_dtype) else next(iter(by_dtype))
        by_dtype.setdefault(host, []).extend(nones)
    out_addr = out.data_ptr()
    out_base_al = (out_addr - out.storage_offset() * dst_es) % 16 == 0
    dst_off = out.storage_offset() + flat_off  # from the storage start (the kernel's out pointer)
    groups = []
    for sdt, idx in by_dtype.items():
        skind, ses = _KIND[sdt]
        idx_np = np.asarray(sorted(idx), dtype=np.int64)  # bucket order: contiguous shares per program
        has = np.asarray([grads[i] is not None for i in idx_np], dtype=bool)
        real_idx = idx_np[has]
        src_off = np.zeros(len(idx_np), dtype=np.int64)
        src_al = np.zeros(len(idx_np), dtype=bool)
        base_idx = -1
        if len(real_idx):
            addrs = np.asarray([grads[i].data_ptr() for i in real_idx], dtype=np.int64)  # type: ignore[union-attr]
            b = _pick_base(addrs)
            base_idx = int(real_idx[b])
            src_off[has] = (addrs - addrs[b]) // ses  # exact (addresses are whole elements); may be < 0
            src_al[has] = aligned16(addrs) & (addrs[b] % 16 == 0)
        dst_al = aligned16(out_addr + flat_off[idx_np] * dst_es) & out_base_al
        flags = has * _HAS_SRC + src_al * _SRC_AL + dst_al * _DST_AL
        work = _work(cfgs, src_off, dst_off[idx_np], sizes_np[idx_np], flags, device, (skind, dst_kind),
                     stats=want_stats, spread=spread)  # fmt: skip
        if work is not None:
            groups.append((work, base_idx))
    return groups


# ------------------------------------------------------------------------------------------ scatter

_scatter_plans = PlanCache()


def launch_scatter(
    flat: torch.Tensor,
    params: list[torch.Tensor],
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """Copy consecutive slices of ``flat`` into ``params``: one launch per distinct parameter dtype.

    ``params`` must be contiguous, element-aligned, on ``flat``'s device and of supported dtypes (the
    public function arranges this). The launch plan is cached like :func:`launch_flatten`'s.
    """
    device = flat.device
    src_kind = _KIND[flat.dtype][0]
    # as the twin: only an fp32 flat buffer is rounded stochastically (fp16 -> bf16 stays RNE)
    stochastic = (
        bool(stochastic_rounding) and src_kind == 0 and any(p.dtype == torch.bfloat16 for p in params)
    )
    cfgs = _configs_for("scatter_sr" if stochastic else "scatter", flat.numel())
    key = (
        device,
        _stream_key(device),
        cfgs,
        stochastic,
        flat.data_ptr(),
        flat.storage_offset(),
        flat.dtype,
        tuple((p.data_ptr(), p.dtype, p.numel()) for p in params),
    )
    plan: list[tuple[_Work, int]] | None = _scatter_plans.get(key)
    if plan is None:
        plan = _scatter_plan(cfgs, flat, params, stochastic)
        _scatter_plans.put(key, plan)
    flat_base = _storage_start(_as_storage(flat))
    k0, k1 = sr_keys(seed) if stochastic else (0, 0)
    rng_offset = int(offset) - flat.storage_offset()  # table offsets count from the storage start
    for work, base_idx in plan:
        _launch_rows(work, flat_base, _as_storage(params[base_idx]), None, (k0, k1, rng_offset))


def _scatter_plan(
    cfgs: tuple[RowsConfig, RowsConfig], flat: torch.Tensor, params: list[torch.Tensor], stochastic: bool
) -> list[tuple[_Work, int]]:
    """Group by parameter dtype; ``[(work, base index in params)]``."""
    src_kind, src_es = _KIND[flat.dtype]
    sizes_np = np.asarray([p.numel() for p in params], dtype=np.int64)
    flat_off = np.cumsum(sizes_np) - sizes_np
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            by_dtype.setdefault(p.dtype, []).append(i)
    flat_addr = flat.data_ptr()
    flat_base_al = (flat_addr - flat.storage_offset() * src_es) % 16 == 0
    src_off = flat.storage_offset() + flat_off  # from the storage start (the kernel's flat pointer)
    plan = []
    for pdt, idx in by_dtype.items():
        dkind, des = _KIND[pdt]
        idx_np = np.asarray(idx, dtype=np.int64)
        addrs = np.asarray([params[i].data_ptr() for i in idx], dtype=np.int64)
        b = _pick_base(addrs)
        dst_off = (addrs - addrs[b]) // des  # exact (addresses are whole elements); may be < 0
        src_al = aligned16(flat_addr + flat_off[idx_np] * src_es) & flat_base_al
        dst_al = aligned16(addrs) & (addrs[b] % 16 == 0)
        flags = _HAS_SRC + src_al * _SRC_AL + dst_al * _DST_AL
        work = _work(cfgs, src_off[idx_np], dst_off, sizes_np[idx_np], flags, flat.device, (src_kind, dkind),
                     stats=False, stochastic=stochastic and dkind == 1)  # fmt: skip
        if work is not None:
            plan.append((work, int(idx_np[b])))
    return plan


def last_tags(op: str) -> tuple[str, ...]:
    """The config tags of the last ``"flatten"`` or ``"scatter"`` launch plan used, one per dtype group (for
    benchmarks: a kernel-3 config that the rows did not qualify for shows as the config that ran instead)."""
    if op == "flatten":
        plan = _flatten_plans.last()
        return tuple(w.cfg.tag for w, _ in plan.groups) if plan is not None else ()
    plan = _scatter_plans.last()
    return tuple(w.cfg.tag for w, _ in plan) if plan is not None else ()


# ------------------------------------------------------------------------------------------- upcast


@triton.jit
def _upcast_tile(src_ptr, dst_ptr, offs, n, scale, scale_ptr, SRC_KIND, SCALE_MODE, MASKED: tl.constexpr):
    mask = offs < n
    x = _to_f32(_load(src_ptr + offs, mask, MASKED), SRC_KIND)
    if SCALE_MODE == 1:
        x = x * scale
    elif SCALE_MODE == 2:
        x = x * tl.load(scale_ptr)
    _store(dst_ptr + offs, x, mask, MASKED)


@triton.jit
def _upcast_kernel(
    src_ptr,
    dst_ptr,
    n,
    scale,
    scale_ptr,
    SRC_KIND: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``dst = fp32(src) * scale``; SCALE_MODE 0: no scale, 1: scalar ``scale``, 2: ``*scale_ptr``.

    Full blocks run unmasked (vectorisable for any ``n``), only the last one is masked.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _upcast_tile(src_ptr, dst_ptr, offs, n, scale, scale_ptr, SRC_KIND, SCALE_MODE, False)
    else:
        _upcast_tile(src_ptr, dst_ptr, offs, n, scale, scale_ptr, SRC_KIND, SCALE_MODE, True)


# NOTE: a streaming elementwise kernel: 2048 elements / 8 warps = 8 per thread (one 16-byte bf16 load, two
# 16-byte fp32 stores). Measured on one H200: 98% of the device-copy ceiling at 256 MB, 90% at 16 MB
# (device time through CUDA-graph replay).
_UPCAST_BLOCK = 2048
_UPCAST_WARPS = 8


def launch_upcast(src: torch.Tensor, dst: torch.Tensor, scale: float | torch.Tensor) -> None:
    """``dst[:] = src.float() * scale`` on flat contiguous tensors (scale: float or fp32 0-dim tensor)."""
    n = src.numel()
    if n == 0:
        return
    kind = _KIND[src.dtype][0]
    if isinstance(scale, torch.Tensor):
        mode_, s_val, s_ptr = 2, 1.0, scale
    elif scale == 1.0:
        mode_, s_val, s_ptr = 0, 1.0, dst
    else:
        mode_, s_val, s_ptr = 1, float(scale), dst
    block = _tile(_UPCAST_BLOCK)
    _upcast_kernel[(triton.cdiv(n, block),)](
        _as_storage(src), dst, n, s_val, s_ptr,
        SRC_KIND=kind, SCALE_MODE=mode_, BLOCK=block, num_warps=_UPCAST_WARPS,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------- AdamW


@triton.jit
def _adamw_tile(
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, gscale_ptr, offs, n, gscale, decay, lerp_w, beta2, one_minus_beta2,
    neg_step_size, bc2_sqrt, eps, G_KIND, GSCALE_MODE, LERP_LOW, DECAY, WRITE_BF16, MASKED: tl.constexpr,
):  # fmt: skip
    mask = offs < n
    p = _load(p_ptr + offs, mask, MASKED)
    m = _load(m_ptr + offs, mask, MASKED)
    v = _load(v_ptr + offs, mask, MASKED)
    g = _to_f32(_load(g_ptr + offs, mask, MASKED), G_KIND)
    if GSCALE_MODE == 1:
        g = g * gscale
    elif GSCALE_MODE == 2:
        g = g * tl.load(gscale_ptr)
    if DECAY:
        p = p * decay
    if LERP_LOW:
        m = m + lerp_w * (g - m)
    else:
        m = g - (g - m) * lerp_w
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    _store(p_ptr + offs, p, mask, MASKED)
    _store(m_ptr + offs, m, mask, MASKED)
    _store(v_ptr + offs, v, mask, MASKED)
    if WRITE_BF16:
        _store(out_ptr + offs, _f32_to_bf16_bits(p, 0, False), mask, MASKED)


@triton.jit
def _adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    gscale_ptr,
    n,
    gscale,
    decay,
    lerp_w,
    beta2,
    one_minus_beta2,
    neg_step_size,
    bc2_sqrt,
    eps,
    G_KIND: tl.constexpr,
    GSCALE_MODE: tl.constexpr,
    LERP_LOW: tl.constexpr,
    DECAY: tl.constexpr,
    WRITE_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Fused AdamW in the operation order of ``torch.optim.AdamW`` (single-tensor path).

    ``lerp_w`` is ``1 - beta1`` when LERP_LOW (torch's ``m + w * (g - m)`` branch) and ``beta1`` otherwise
    (``g - (g - m) * (1 - w)``). sqrt and the divisions are IEEE round-to-nearest (``sqrt_rn``/``div_rn``),
    not the GPU's approximate defaults. Full blocks run unmasked, only the last one is masked.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _adamw_tile(
            p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, gscale_ptr, offs, n, gscale, decay, lerp_w, beta2,
            one_minus_beta2, neg_step_size, bc2_sqrt, eps, G_KIND, GSCALE_MODE, LERP_LOW, DECAY, WRITE_BF16,
            False,
        )  # fmt: skip
    else:
        _adamw_tile(
            p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, gscale_ptr, offs, n, gscale, decay, lerp_w, beta2,
            one_minus_beta2, neg_step_size, bc2_sqrt, eps, G_KIND, GSCALE_MODE, LERP_LOW, DECAY, WRITE_BF16,
            True,
        )  # fmt: skip


# NOTE: 14-16 bytes in and 12-14 out per element with ~20 flops: memory-bound. 1024 elements / 4 warps
# = 8 per thread keeps four fp32 streams at 2 x 16-byte vectors each. Measured on one H200: 99% of the
# device-copy ceiling at 256 MB, 94% at 16 MB (28 B/element, CUDA-graph replay).
_ADAMW_BLOCK = 1024
_ADAMW_WARPS = 4


def launch_adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float | torch.Tensor,
    param_bf16_out: torch.Tensor | None,
) -> None:
    """One fused AdamW step on flat contiguous tensors (arguments checked by the public function)."""
    n = param.numel()
    if n == 0:
        return
    # Host scalars in double, as torch computes them, then rounded to fp32 by the launch like torch's
    # scalar arguments are.
    lr, beta2, weight_decay = hyper.lr, hyper.beta2, hyper.weight_decay
    bc1 = hyper.bias_correction1(step)
    bc2_sqrt = hyper.bias_correction2(step) ** 0.5
    w = 1.0 - hyper.beta1
    lerp_low = abs(w) < 0.5
    lerp_w = w if lerp_low else float(np.float32(1.0) - np.float32(w))
    if isinstance(grad_scale, torch.Tensor):
        gmode, gval, gptr = 2, 1.0, grad_scale
    elif grad_scale == 1.0:
        gmode, gval, gptr = 0, 1.0, param
    else:
        gmode, gval, gptr = 1, float(grad_scale), param
    decay = 1.0 - lr * weight_decay
    out = _as_storage(param_bf16_out) if param_bf16_out is not None else param
    block = _tile(_ADAMW_BLOCK)
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, _as_storage(grad), exp_avg, exp_avg_sq, out, gptr,
        n, gval, decay, lerp_w, beta2, 1.0 - beta2, -(lr / bc1), bc2_sqrt, hyper.eps,
        G_KIND=_KIND[grad.dtype][0], GSCALE_MODE=gmode, LERP_LOW=lerp_low, DECAY=weight_decay != 0,
        WRITE_BF16=param_bf16_out is not None, BLOCK=block, num_warps=_ADAMW_WARPS,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------- smoke


def smoke_test(device: torch.device) -> None:
    """Compile and run each kernel family once on a few elements; raise if anything is off.

    Run once per device type before the first real dispatch, so a broken Triton install (no compiler,
    a driver mismatch, an interpreter enabled too late) falls back to the twins instead of failing a step.
    """
    g = torch.tensor([1.0, -2.5, 3.0], device=device)
    out = torch.empty(4, dtype=torch.bfloat16, device=device)
    stats = torch.zeros(2, dtype=torch.float32, device=device)
    launch_flatten([g, None], [3, 1], out, stats)
    spread = torch.zeros(_sm_count(device) * _configs.SPREAD_ROWS_PER_SM, 2, dtype=torch.float32, device=device)
    launch_flatten([g, None], [3, 1], out, spread)
    back = torch.empty(3, dtype=torch.float32, device=device)
    launch_scatter(out[:3], [back], stochastic_rounding=True, seed=1)
    up = torch.empty(3, dtype=torch.float32, device=device)
    launch_upcast(out[:3], up, 2.0)
    ok = (
        torch.equal(back, g)
        and torch.equal(up, g * 2)
        and torch.equal(out[3:].float().cpu(), torch.zeros(1))
        and torch.equal(stats.cpu(), torch.tensor([16.25, 0.0]))
        and torch.equal(spread.sum(dim=0).cpu(), torch.tensor([16.25, 0.0]))
    )
    if not ok:
        raise RuntimeError("Triton kernels produced wrong results in the smoke test")
