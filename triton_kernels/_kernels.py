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

from ._tables import TableCache, chunk_rows, common_alignment  # noqa: TID251 (relative, as the ban asks)

F32: tl.constexpr = tl.constexpr(0)
BF16: tl.constexpr = tl.constexpr(1)
F16: tl.constexpr = tl.constexpr(2)

# torch dtype -> (kind, element type the kernel addresses the storage with, element size)
_KIND: dict[torch.dtype, tuple[int, tl.dtype, int]] = {
    torch.float32: (0, tl.float32, 4),
    torch.bfloat16: (1, tl.int16, 2),
    torch.float16: (2, tl.float16, 2),
}
SUPPORTED_DTYPES = frozenset(_KIND)


def mode() -> str:
    """``"interpreter"``, ``"native"`` or ``"inconsistent"`` (Triton imported before TRITON_INTERPRET was set)."""
    from triton.runtime.interpreter import InterpretedFunction

    ours = isinstance(_upcast_kernel, InterpretedFunction)
    stdlib = isinstance(tl.randint, InterpretedFunction)
    if ours != stdlib:
        return "inconsistent"
    return "interpreter" if ours else "native"


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
def _convert(x, SRC_KIND: tl.constexpr, DST_KIND: tl.constexpr):
    """Loaded ``SRC_KIND`` storage -> (``DST_KIND`` storage to store, its exact fp32 value for stats)."""
    if SRC_KIND == DST_KIND:
        return x, _to_f32(x, SRC_KIND)
    else:
        y = _from_f32(_to_f32(x, SRC_KIND), 0, DST_KIND, False)
        return y, _to_f32(y, DST_KIND)


# ------------------------------------------------------------------------------------------ flatten


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
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per table row ``[src_off, dst_off, n_src, n]``: copy + cast into ``out``, and write
    this program's [sum of squares, non-finite count] of the *stored* values to the partial buffers.

    ``src_off`` is in elements from ``src_base_ptr`` (the lowest-addressed gradient of this dtype group),
    so every source is ``base + offset``: unlike an int -> pointer cast, this keeps the base's 16-byte
    alignment visible to the compiler, which then emits 16-byte vector accesses when ``ALIGNED``.
    """
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 4
    src_off = tl.load(row)
    dst_off = tl.load(row + 1)
    n_src = tl.load(row + 2)
    n = tl.load(row + 3)
    if ALIGNED:
        # Host checked: every source address and destination byte offset is 16-byte aligned.
        src_off = tl.multiple_of(src_off, 4 if SRC_KIND == 0 else 8)
        dst_off = tl.multiple_of(dst_off, 4 if DST_KIND == 0 else 8)
    src = src_base_ptr + src_off
    dst = out_ptr + dst_off
    lane = tl.arange(0, BLOCK)
    acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
    acc_bad = tl.zeros([BLOCK], dtype=tl.int32)
    # Whole tiles without masks (a mask against a runtime count blocks vector accesses), then the tail.
    # Rows without a source (None grads: n_src == 0) go entirely through the masked loop, loading zeros.
    n_full = (n - n % BLOCK) * (n_src > 0).to(tl.int64)
    for start in range(0, n_full, BLOCK):
        offs = start + lane
        y, v = _convert(tl.load(src + offs), SRC_KIND, DST_KIND)
        tl.store(dst + offs, y)
        if STATS:
            acc_sq += v * v
            acc_bad += _nonfinite(v)
    for start in range(n_full, n, BLOCK):
        offs = start + lane
        y, v = _convert(tl.load(src + offs, mask=offs < n_src, other=0), SRC_KIND, DST_KIND)
        tl.store(dst + offs, y, mask=offs < n)
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


_flatten_tables = TableCache()

# NOTE: 1024-element tiles with 4 warps = 8 elements per thread per iteration: one 16-byte vector per
# thread for bf16 (two for fp32) when the table is aligned, the width that saturates HBM for a plain copy
# on Hopper/Ampere. Each program loops over up to CHUNK (16 Ki) elements, so the tile only sets the
# vector width and the registers, not the grid. Tune with benchmarks/bench_triton.py.
_FLATTEN_BLOCK = 1024
_FLATTEN_WARPS = 4
# NOTE: the finalize pass reads 8 bytes per program of the main pass (a few KiB); one program suffices.
_FINALIZE_BLOCK = 1024


def _stream_key(device: torch.device) -> int:
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


def _base_offsets(tensors: list[torch.Tensor], elem_size: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(lowest-addressed tensor, each tensor's element offset from it, each address) for one dtype group.

    Offsets are exact: every address is a multiple of the element size (checked by the public functions).
    """
    addrs = np.asarray([t.data_ptr() for t in tensors], dtype=np.int64)
    lo = int(np.argmin(addrs))
    return tensors[lo], (addrs - addrs[lo]) // elem_size, addrs


def launch_flatten(
    grads: list[torch.Tensor | None],
    sizes: list[int],
    out: torch.Tensor,
    stats: torch.Tensor | None,
) -> None:
    """Copy ``grads`` into ``out`` and accumulate stats: one launch per distinct source dtype + one finalize.

    ``grads`` entries must already be contiguous, on ``out``'s device, of a supported dtype, element-aligned
    and of the right size (the public function checks). ``None`` entries are zero-filled by the kernel.
    """
    device = out.device
    dst_kind, _, dst_es = _KIND[out.dtype]
    sizes_np = np.asarray(sizes, dtype=np.int64)
    flat_off = np.cumsum(sizes_np) - sizes_np
    # Group entries by source dtype; None entries ride along in the out-dtype group (or the first group).
    groups: dict[torch.dtype, list[int]] = {}
    nones: list[int] = []
    for i, g in enumerate(grads):
        if g is None:
            nones.append(i)
        else:
            groups.setdefault(g.dtype, []).append(i)
    if nones:
        host = out.dtype if (out.dtype in groups or not groups) else next(iter(groups))
        groups.setdefault(host, []).extend(nones)
    out_s = _as_storage(out)
    stream = _stream_key(device)
    plans = []
    total_rows = 0
    for sdt, idx in groups.items():
        skind, _, ses = _KIND[sdt]
        idx_np = np.asarray(idx, dtype=np.int64)
        real = [grads[i] for i in idx if grads[i] is not None]
        base, real_off, real_addr = _base_offsets(real, ses) if real else (out, np.zeros(0, np.int64), None)
        has = np.asarray([grads[i] is not None for i in idx], dtype=bool)
        src_off = np.zeros(len(idx), dtype=np.int64)
        src_off[has] = real_off
        key = (
            "flatten",
            device,
            stream,
            sdt,
            out.dtype,
            base.data_ptr(),
            tuple(src_off.tolist()),
            tuple(has.tolist()),
            tuple(sizes_np[idx_np].tolist()),
            tuple(flat_off[idx_np].tolist()),
        )

        def build(src_off=src_off, idx_np=idx_np, has=has) -> np.ndarray:
            return chunk_rows(src_off, flat_off[idx_np], sizes_np[idx_np], has)

        table = _flatten_tables.get_or_build(key, build, device)
        rows = table.shape[0]
        if rows == 0:
            continue
        aligned = (
            (real_addr is None or common_alignment(real_addr) == 16)
            and common_alignment(flat_off[idx_np] * dst_es) == 16
            and out.data_ptr() % 16 == 0
        )
        plans.append((table, _as_storage(base), rows, total_rows, skind, aligned))
        total_rows += rows
    if total_rows == 0:
        return
    want_stats = stats is not None
    if want_stats:
        part_sq = torch.empty(total_rows, dtype=torch.float32, device=device)
        part_bad = torch.empty(total_rows, dtype=torch.int32, device=device)
    else:
        part_sq = part_bad = out_s  # unused (STATS=False)
    for table, base_s, rows, part_base, skind, aligned in plans:
        _flatten_kernel[(rows,)](
            table, base_s, out_s, part_sq, part_bad, part_base,
            SRC_KIND=skind, DST_KIND=dst_kind, STATS=want_stats, ALIGNED=aligned,
            BLOCK=_tile(_FLATTEN_BLOCK), num_warps=_FLATTEN_WARPS,
        )  # fmt: skip
    if want_stats:
        _stats_finalize_kernel[(1,)](part_sq, part_bad, total_rows, stats, BLOCK=_FINALIZE_BLOCK, num_warps=4)


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


@triton.jit(do_not_specialize=["seed", "rng_offset"])
def _scatter_kernel(
    table_ptr,
    flat_ptr,
    seed,
    rng_offset,
    DST_TY: tl.constexpr,
    SRC_KIND: tl.constexpr,
    DST_KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per table row ``[dst_addr, src_off, n, n]``: ``dst[i] = cast(flat[src_off + i])``."""
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 4
    dst_addr = tl.load(row)
    src_off = tl.load(row + 1)
    n = tl.load(row + 3)
    if ALIGNED:
        dst_addr = tl.multiple_of(dst_addr, 16)
        src_off = tl.multiple_of(src_off, 8 if SRC_KIND != 0 else 4)
    dst = dst_addr.to(tl.pointer_type(DST_TY))
    src = flat_ptr + src_off
    lane = tl.arange(0, BLOCK)
    n_full = n - n % BLOCK
    for start in range(0, n_full, BLOCK):  # whole tiles, unmasked (vectorisable)
        offs = start + lane
        y = _scatter_convert(
            tl.load(src + offs), src_off + offs + rng_offset, seed, SRC_KIND, DST_KIND, STOCHASTIC
        )
        tl.store(dst + offs, y)
    for start in range(n_full, n, BLOCK):  # the tail
        offs = start + lane
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0)
        y = _scatter_convert(x, src_off + offs + rng_offset, seed, SRC_KIND, DST_KIND, STOCHASTIC)
        tl.store(dst + offs, y, mask=mask)


_scatter_tables = TableCache()

# NOTE: same tile reasoning as flatten (8 elements per thread, 16-byte vectors for bf16 when aligned);
# stochastic rounding adds ten Philox rounds per element, still under the memory time at this width.
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

    ``params`` must be contiguous, on ``flat``'s device and of supported dtypes (the public function
    arranges this).
    """
    device = flat.device
    src_kind, _, src_es = _KIND[flat.dtype]
    sizes_np = np.asarray([p.numel() for p in params], dtype=np.int64)
    flat_off = np.cumsum(sizes_np) - sizes_np
    groups: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.dtype, []).append(i)
    flat_s = _as_storage(flat)
    stream = _stream_key(device)
    for pdt, idx in groups.items():
        dkind, dty, des = _KIND[pdt]
        idx_np = np.asarray(idx, dtype=np.int64)
        addrs = np.asarray([params[i].data_ptr() for i in idx], dtype=np.int64)
        key = (
            "scatter",
            device,
            stream,
            flat.dtype,
            pdt,
            tuple(addrs.tolist()),
            tuple(sizes_np[idx_np].tolist()),
            tuple(flat_off[idx_np].tolist()),
        )

        def build(addrs=addrs, idx_np=idx_np, des=des) -> np.ndarray:
            return chunk_rows(addrs, flat_off[idx_np], sizes_np[idx_np], np.full(len(idx_np), des))

        table = _scatter_tables.get_or_build(key, build, device)
        rows = table.shape[0]
        if rows == 0:
            continue
        aligned = (
            common_alignment(addrs) == 16
            and common_alignment(flat_off[idx_np] * src_es) == 16
            and flat.data_ptr() % 16 == 0
        )
        _scatter_kernel[(rows,)](
            table, flat_s, int(seed), int(offset),
            DST_TY=dty, SRC_KIND=src_kind, DST_KIND=dkind, STOCHASTIC=bool(stochastic_rounding),
            ALIGNED=aligned, BLOCK=_tile(_SCATTER_BLOCK), num_warps=_SCATTER_WARPS,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------- upcast


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
    """``dst = fp32(src) * scale``; SCALE_MODE 0: no scale, 1: scalar ``scale``, 2: ``*scale_ptr``."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _to_f32(tl.load(src_ptr + offs, mask=mask, other=0), SRC_KIND)
    if SCALE_MODE == 1:
        x = x * scale
    elif SCALE_MODE == 2:
        x = x * tl.load(scale_ptr)
    tl.store(dst_ptr + offs, x, mask=mask)


# NOTE: a streaming elementwise kernel: 2048 elements / 8 warps = 8 per thread (one 16-byte bf16 load, two
# 16-byte fp32 stores), enough programs (>= 4 per SM) from 1 M elements up; the grid covers n exactly.
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
    not the GPU's approximate defaults.
    """
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    g = _to_f32(tl.load(g_ptr + offs, mask=mask, other=0), G_KIND)
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
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_BF16:
        tl.store(out_ptr + offs, _f32_to_bf16_bits(p, 0, False), mask=mask)


# NOTE: 16-20 bytes in and 12-14 out per element with ~20 flops: memory-bound. 1024 elements / 4 warps
# = 8 per thread keeps four fp32 streams at 2 x 16-byte vectors each without spilling.
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
