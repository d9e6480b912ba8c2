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
* Multi-tensor ops (flatten, scatter) launch one 1-D grid per dtype group over a device *work table* of
  rows ``[offset from the group's base tensor, offset in the bucket, flags, n]`` (see :mod:`._tables`).
  Element offsets from a base pointer argument, rather than raw addresses cast with ``tl.pointer_type``,
  keep the base's 16-byte alignment (from Triton's argument specialisation) visible to the compiler; the
  per-row flags say which side is 16-byte aligned, and the kernel picks the matching unmasked tile loop
  (16-byte vector loads / stores on the aligned sides), then a masked tail. The plan is cached per exact
  set of addresses, so a repeated call uploads nothing.
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

import numpy as np
import torch
import triton
import triton.language as tl

from . import _tables
from ._tables import PlanCache, aligned16, chunk_rows

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
        from triton.runtime.interpreter import InterpretedFunction

        ours = isinstance(_upcast_kernel, InterpretedFunction)
        stdlib = isinstance(tl.randint, InterpretedFunction)
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
def _aligned_off(off, V: tl.constexpr):
    """``off`` rebuilt as ``(off // V) * V``: the same value for a row known (from its flags) to be aligned,
    but now a *new* SSA value whose divisibility the compiler derives by itself. (``tl.multiple_of`` would
    tag the defining load and leak the claim into the unaligned branches and the tail.)"""
    return (off // V) * V


@triton.jit
def _convert(x, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr):
    """Loaded ``SRC_KIND`` storage -> (``DST_KIND`` storage to store, its exact fp32 value for stats)."""
    if SRC_KIND == DST_KIND:
        return x, _to_f32(x, SRC_KIND)
    else:
        y = _from_f32(_to_f32(x, SRC_KIND), 0, DST_KIND, False)
        return y, _to_f32(y, DST_KIND)


# ------------------------------------------------------------------------------------------ flatten

# Row flag bits shared by the flatten and scatter tables.
_HAS_SRC = 1  # flatten: the entry has a gradient (else the kernel writes zeros)
_SRC_AL = 2  # the row's source address is 16-byte aligned
_DST_AL = 4  # the row's destination address is 16-byte aligned


@triton.jit
def _flatten_tiles(src, dst, stop, lane, acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, BLOCK: tl.constexpr):
    """Whole tiles ``[0, stop)`` without masks; returns the updated stats accumulators."""
    for start in range(0, stop, BLOCK):
        offs = start + lane
        y, v = _convert(tl.load(src + offs), SRC_KIND, DST_KIND)
        tl.store(dst + offs, y)
        if STATS:
            acc_sq += v * v
            acc_bad += _nonfinite(v)
    return acc_sq, acc_bad


@triton.jit
def _flatten_kernel(
    table_ptr,
    src_base_ptr,
    out_ptr,
    part_sq_ptr,
    part_bad_ptr,
    part_base,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per table row ``[src_off, dst_off, flags, n]``: copy + cast into ``out``, and write
    this program's [sum of squares, non-finite count] of the *stored* values to the partial buffers.

    ``src_off`` is in elements from ``src_base_ptr`` (the lowest-addressed gradient of this dtype group):
    unlike an int -> pointer cast, ``base + offset`` keeps the base's 16-byte alignment visible to the
    compiler. Whole tiles run unmasked (a mask against a runtime count blocks vector accesses), with
    16-byte vector loads / stores on the sides the row's flags say are aligned; then the masked tail.
    Rows without a source (None grads) go entirely through the masked loop, loading zeros.
    """
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 4
    src_off = tl.load(row)
    dst_off = tl.load(row + 1)
    flags = tl.load(row + 2)
    n = tl.load(row + 3)
    has_src = (flags & 1) != 0
    lane = tl.arange(0, BLOCK)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    acc_bad = tl.zeros([BLOCK], dtype=tl.int32)
    n_src = tl.where(has_src, n, 0)  # elements to read; None rows read none and store zeros
    n_full = n_src - n_src % BLOCK
    src_al = (flags & 2) != 0
    dst_al = (flags & 4) != 0
    VS: tl.constexpr = 4 if SRC_KIND == 0 else 8  # elements per 16 bytes
    VD: tl.constexpr = 4 if DST_KIND == 0 else 8
    if src_al & dst_al:
        acc_sq, acc_bad = _flatten_tiles(
            src_base_ptr + _aligned_off(src_off, VS), out_ptr + _aligned_off(dst_off, VD), n_full, lane,
            acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, BLOCK,
        )  # fmt: skip
    elif src_al:
        acc_sq, acc_bad = _flatten_tiles(
            src_base_ptr + _aligned_off(src_off, VS), out_ptr + dst_off, n_full, lane,
            acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, BLOCK,
        )  # fmt: skip
    elif dst_al:
        acc_sq, acc_bad = _flatten_tiles(
            src_base_ptr + src_off, out_ptr + _aligned_off(dst_off, VD), n_full, lane,
            acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, BLOCK,
        )  # fmt: skip
    else:
        acc_sq, acc_bad = _flatten_tiles(
            src_base_ptr + src_off, out_ptr + dst_off, n_full, lane,
            acc_sq, acc_bad, SRC_KIND, DST_KIND, STATS, BLOCK,
        )  # fmt: skip
    src = src_base_ptr + src_off
    dst = out_ptr + dst_off
    for start in range(n_full, n, BLOCK):
        offs = start + lane
        mask = offs < n
        y, v = _convert(tl.load(src + offs, mask=offs < n_src, other=0), SRC_KIND, DST_KIND)
        tl.store(dst + offs, y, mask=mask)
        if STATS:
            acc_sq += v * v  # masked lanes loaded 0 -> contribute 0
            acc_bad += _nonfinite(v)
    if STATS:
        tl.store(part_sq_ptr + part_base + pid, tl.sum(acc_sq, axis=0))
        tl.store(part_bad_ptr + part_base + pid, tl.sum(acc_bad, axis=0))


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


_flatten_plans = PlanCache()

# NOTE: 1024-element tiles with 4 warps = 8 elements per thread per iteration (one 16-byte vector for bf16,
# two for fp32, on aligned rows). Measured on one H200 (bench_triton.py --sweep: BLOCK 1024/2048/4096 x
# warps 4/8 x CHUNK 16/64 Ki, 256 MB bf16 bucket, device time through CUDA-graph replay, one run each):
# 1024 x 4 x 16 Ki was the best flatten+stats config, 81% of the 4.2 TB/s device-copy ceiling with
# 8-aligned sizes and 77% with odd sizes; 4096-element tiles lost 10-15 points.
_FLATTEN_BLOCK = 1024
_FLATTEN_WARPS = 4
# NOTE: the finalize pass reads 8 bytes per program of the main pass (a few KiB); one program suffices.
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


def launch_flatten(
    grads: list[torch.Tensor | None],
    sizes: list[int],
    out: torch.Tensor,
    stats: torch.Tensor | None,
) -> None:
    """Copy ``grads`` into ``out`` and accumulate stats: one launch per distinct source dtype + one finalize.

    ``grads`` entries must already be contiguous, on ``out``'s device, of a supported dtype, element-aligned
    and of the right size (the public function checks). ``None`` entries are zero-filled by the kernel.
    The launch plan (work tables, grouping) is cached by the exact addresses, dtypes and sizes, so a
    repeated call costs one pass over the list plus the launches.
    """
    device = out.device
    chunk = _tables.CHUNK
    key = (
        device,
        _stream_key(device),
        chunk,
        out.data_ptr(),
        out.storage_offset(),
        out.dtype,
        tuple(sizes),
        tuple((g.data_ptr(), g.dtype) if g is not None else None for g in grads),
    )
    plan = _flatten_plans.get(key)
    if plan is None:
        plan = _flatten_plan(grads, sizes, out, chunk)
        _flatten_plans.put(key, plan)
    groups, total_rows = plan
    if total_rows == 0:
        return
    out_s = _as_storage(out)
    out_base = _storage_start(out_s)
    want_stats = stats is not None
    if want_stats:
        part_sq = torch.empty(total_rows, dtype=torch.float32, device=device)
        part_bad = torch.empty(total_rows, dtype=torch.int32, device=device)
    else:
        part_sq = part_bad = out_s  # unused (STATS=False)
    block = _tile(_FLATTEN_BLOCK)
    dst_kind = _KIND[out.dtype][0]
    for table, base_idx, rows, part_base, skind in groups:
        base = out_s if base_idx < 0 else _as_storage(grads[base_idx])  # type: ignore[arg-type]
        _flatten_kernel[(rows,)](
            table, base, out_base, part_sq, part_bad, part_base,
            SRC_KIND=skind, DST_KIND=dst_kind, STATS=want_stats, BLOCK=block, num_warps=_FLATTEN_WARPS,
        )  # fmt: skip
    if want_stats:
        _stats_finalize_kernel[(1,)](part_sq, part_bad, total_rows, stats, BLOCK=_FINALIZE_BLOCK, num_warps=4)


def _flatten_plan(
    grads: list[torch.Tensor | None], sizes: list[int], out: torch.Tensor, chunk: int
) -> tuple[list[tuple[torch.Tensor, int, int, int, int]], int]:
    """Group by source dtype and build each group's device work table.

    Returns ``([(table, base index in grads or -1 for out, rows, first partial slot, src kind)], rows)``.
    """
    device = out.device
    dst_es = _KIND[out.dtype][1]
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
    total_rows = 0
    for sdt, idx in by_dtype.items():
        skind, ses = _KIND[sdt]
        idx_np = np.asarray(idx, dtype=np.int64)
        has = np.asarray([grads[i] is not None for i in idx], dtype=bool)
        real_idx = idx_np[has]
        src_off = np.zeros(len(idx), dtype=np.int64)
        src_al = np.zeros(len(idx), dtype=bool)
        base_idx = -1
        if len(real_idx):
            addrs = np.asarray([grads[i].data_ptr() for i in real_idx], dtype=np.int64)  # type: ignore[union-attr]
            b = _pick_base(addrs)
            base_idx = int(real_idx[b])
            src_off[has] = (addrs - addrs[b]) // ses  # exact (addresses are whole elements); may be < 0
            src_al[has] = aligned16(addrs) & (addrs[b] % 16 == 0)
        dst_al = aligned16(out_addr + flat_off[idx_np] * dst_es) & out_base_al
        flags = has * _HAS_SRC + src_al * _SRC_AL + dst_al * _DST_AL
        rows_np = chunk_rows(src_off, dst_off[idx_np], sizes_np[idx_np], flags, chunk)
        if len(rows_np) == 0:
            continue
        groups.append((_upload(rows_np, device), base_idx, len(rows_np), total_rows, skind))
        total_rows += len(rows_np)
    return groups, total_rows


# ------------------------------------------------------------------------------------------ scatter


@triton.jit
def _scatter_convert(
    x, counter, seed, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr, STOCHASTIC: tl.constexpr
):
    """Flat storage -> parameter storage; stochastic rounding (Philox at ``counter``) only for fp32 -> bf16."""
    if SRC_KIND == DST_KIND:
        return x  # same format: a plain bit copy
    else:
        xf = _to_f32(x, SRC_KIND)
        if STOCHASTIC and DST_KIND == 1:
            # Keyed by (seed, flat index + rng_offset): independent of the launch layout.
            return _from_f32(xf, tl.randint(seed, counter), DST_KIND, True)
        else:
            return _from_f32(xf, 0, DST_KIND, False)


@triton.jit
def _scatter_tiles(
    src, dst, stop, src_off, rng_offset, seed, lane, SRC_KIND, DST_KIND, STOCHASTIC, BLOCK: tl.constexpr
):
    """Whole tiles ``[0, stop)`` without masks."""
    for start in range(0, stop, BLOCK):
        offs = start + lane
        y = _scatter_convert(
            tl.load(src + offs), src_off + offs + rng_offset, seed, SRC_KIND, DST_KIND, STOCHASTIC
        )
        tl.store(dst + offs, y)


@triton.jit(do_not_specialize=["seed", "rng_offset"])
def _scatter_kernel(
    table_ptr,
    dst_base_ptr,
    flat_ptr,
    seed,
    rng_offset,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per table row ``[dst_off, src_off, flags, n]``: ``dst[i] = cast(flat[src_off + i])``.

    ``dst_off`` is in elements from ``dst_base_ptr`` (the lowest-addressed parameter of this dtype group);
    tiles, flags and tail as in :func:`_flatten_kernel`.
    """
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 4
    dst_off = tl.load(row)
    src_off = tl.load(row + 1)
    flags = tl.load(row + 2)
    n = tl.load(row + 3)
    lane = tl.arange(0, BLOCK)
    n_full = n - n % BLOCK
    src_al = (flags & 2) != 0
    dst_al = (flags & 4) != 0
    VS: tl.constexpr = 4 if SRC_KIND == 0 else 8  # elements per 16 bytes
    VD: tl.constexpr = 4 if DST_KIND == 0 else 8
    if src_al & dst_al:
        _scatter_tiles(
            flat_ptr + _aligned_off(src_off, VS), dst_base_ptr + _aligned_off(dst_off, VD), n_full, src_off,
            rng_offset, seed, lane, SRC_KIND, DST_KIND, STOCHASTIC, BLOCK,
        )  # fmt: skip
    elif src_al:
        _scatter_tiles(
            flat_ptr + _aligned_off(src_off, VS), dst_base_ptr + dst_off, n_full, src_off,
            rng_offset, seed, lane, SRC_KIND, DST_KIND, STOCHASTIC, BLOCK,
        )  # fmt: skip
    elif dst_al:
        _scatter_tiles(
            flat_ptr + src_off, dst_base_ptr + _aligned_off(dst_off, VD), n_full, src_off,
            rng_offset, seed, lane, SRC_KIND, DST_KIND, STOCHASTIC, BLOCK,
        )  # fmt: skip
    else:
        _scatter_tiles(
            flat_ptr + src_off, dst_base_ptr + dst_off, n_full, src_off,
            rng_offset, seed, lane, SRC_KIND, DST_KIND, STOCHASTIC, BLOCK,
        )  # fmt: skip
    src = flat_ptr + src_off
    dst = dst_base_ptr + dst_off
    for start in range(n_full, n, BLOCK):  # the tail
        offs = start + lane
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0)
        y = _scatter_convert(x, src_off + offs + rng_offset, seed, SRC_KIND, DST_KIND, STOCHASTIC)
        tl.store(dst + offs, y, mask=mask)


_scatter_plans = PlanCache()

# NOTE: same sweep as flatten: 1024 x 4 x 16 Ki gave 96% (aligned) / 94% (odd sizes) of the copy ceiling
# for fp32 -> bf16; 2048 x 8 measured 98.7% / 97.5%, a gap within what one run per config can resolve, so
# both ops keep one setting. Stochastic rounding is Philox-bound: ~44% of the ceiling (1.9 TB/s).
_SCATTER_BLOCK = 1024
_SCATTER_WARPS = 4


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
    chunk = _tables.CHUNK
    key = (
        device,
        _stream_key(device),
        chunk,
        flat.data_ptr(),
        flat.storage_offset(),
        flat.dtype,
        tuple((p.data_ptr(), p.dtype, p.numel()) for p in params),
    )
    plan = _scatter_plans.get(key)
    if plan is None:
        plan = _scatter_plan(flat, params, chunk)
        _scatter_plans.put(key, plan)
    flat_base = _storage_start(_as_storage(flat))
    rng_offset = int(offset) - flat.storage_offset()  # table offsets count from the storage start
    src_kind = _KIND[flat.dtype][0]
    block = _tile(_SCATTER_BLOCK)
    for table, base_idx, rows, dkind in plan:
        _scatter_kernel[(rows,)](
            table, _as_storage(params[base_idx]), flat_base, int(seed), rng_offset,
            SRC_KIND=src_kind, DST_KIND=dkind, STOCHASTIC=bool(stochastic_rounding),
            BLOCK=block, num_warps=_SCATTER_WARPS,
        )  # fmt: skip


def _scatter_plan(
    flat: torch.Tensor, params: list[torch.Tensor], chunk: int
) -> list[tuple[torch.Tensor, int, int, int]]:
    """Group by parameter dtype; ``[(table, base index in params, rows, dst kind)]``."""
    src_es = _KIND[flat.dtype][1]
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
        flags = src_al * _SRC_AL + dst_al * _DST_AL
        rows_np = chunk_rows(dst_off, src_off[idx_np], sizes_np[idx_np], flags, chunk)
        plan.append((_upload(rows_np, flat.device), int(idx_np[b]), len(rows_np), dkind))
    return plan


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
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float | torch.Tensor,
    param_out_bf16: torch.Tensor | None,
) -> None:
    """One fused AdamW step on flat contiguous tensors (arguments checked by the public function)."""
    n = param.numel()
    if n == 0:
        return
    # Host scalars in double, as torch computes them, then rounded to fp32 by the launch like torch's
    # scalar arguments are.
    bc1 = 1.0 - beta1**step
    bc2_sqrt = (1.0 - beta2**step) ** 0.5
    w = 1.0 - beta1
    lerp_low = abs(w) < 0.5
    lerp_w = w if lerp_low else float(np.float32(1.0) - np.float32(w))
    if isinstance(grad_scale, torch.Tensor):
        gmode, gval, gptr = 2, 1.0, grad_scale
    elif grad_scale == 1.0:
        gmode, gval, gptr = 0, 1.0, param
    else:
        gmode, gval, gptr = 1, float(grad_scale), param
    decay = 1.0 - lr * weight_decay
    out = _as_storage(param_out_bf16) if param_out_bf16 is not None else param
    block = _tile(_ADAMW_BLOCK)
    _adamw_kernel[(triton.cdiv(n, block),)](
        param, _as_storage(grad), exp_avg, exp_avg_sq, out, gptr,
        n, gval, decay, lerp_w, beta2, 1.0 - beta2, -(lr / bc1), bc2_sqrt, eps,
        G_KIND=_KIND[grad.dtype][0], GSCALE_MODE=gmode, LERP_LOW=lerp_low, DECAY=weight_decay != 0,
        WRITE_BF16=param_out_bf16 is not None, BLOCK=block, num_warps=_ADAMW_WARPS,
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
    back = torch.empty(3, dtype=torch.float32, device=device)
    launch_scatter(out[:3], [back], stochastic_rounding=True, seed=1)
    up = torch.empty(3, dtype=torch.float32, device=device)
    launch_upcast(out[:3], up, 2.0)
    ok = (
        torch.equal(back, g)
        and torch.equal(up, g * 2)
        and torch.equal(out[3:].float().cpu(), torch.zeros(1))
        and torch.equal(stats.cpu(), torch.tensor([16.25, 0.0]))
    )
    if not ok:
        raise RuntimeError("Triton kernels produced wrong results in the smoke test")
