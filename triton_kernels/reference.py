"""Eager-torch twins of the GPU kernels: the test oracle and the fallback without Triton or CUDA.

Layouts shared with the Triton kernels:

* a *bucket* is a flat 1-D tensor; entry ``i`` occupies ``flat[sum(sizes[:i]) : sum(sizes[:i+1])]``;
* *stats* is a float32 tensor of shape ``[2]`` on the bucket's device: ``[sum of squares, non-finite count]``,
  accumulated (``+=``) so several buckets or chunks can share one.

The Triton kernels match these twins bit for bit on every value except NaN bit patterns (torch's own
fp32 -> bf16 NaN encoding depends on which CPU code path runs), the AdamW arithmetic (same operation order,
fp32 rounding tolerance: contraction into FMAs may differ) and the sum of squares (each side adds in a fixed
order of its own, so the two agree to fp32 rounding and each gives the same bits run to run). Stochastic
rounding uses the same counter-based hash (:func:`noise16`) on both sides, so it matches bit for bit as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cpu_ext import AdamWHyper
from ..cpu_ext import reference as _adamw_reference

__all__ = [
    "STATS_BLOCK",
    "adamw_flat_",
    "flatten_grads_with_stats_",
    "noise16",
    "scatter_flat_",
    "sr_keys",
    "stochastic_round_to_bf16",
    "sumsq_nonfinite",
    "upcast_",
]


def flatten_grads_with_stats_(
    grads: Sequence[torch.Tensor | None],
    sizes: Sequence[int],
    out: torch.Tensor,
    stats: torch.Tensor | None = None,
) -> None:
    """Copy ``grads`` back to back into ``out`` (``None`` writes zeros) and add their statistics to ``stats``.

    Args:
        grads: per-parameter gradients of any shape, ``grads[i].numel() == sizes[i]``.
        sizes: element count of each entry.
        out: flat destination of ``sum(sizes)`` elements, usually bf16.
        stats: float32 ``[2]`` or ``[rows, 2]`` on ``out``'s device; its column sums grow by the statistics
            (here: row 0); ``None`` skips them.
    """
    if sum(sizes) != out.numel():
        raise ValueError(f"entries hold {sum(sizes)} elements but the bucket has {out.numel()}")
    offset = 0
    for g, n in zip(grads, sizes, strict=True):
        dst = out[offset : offset + n]
        if g is None:
            dst.zero_()
        else:
            if g.numel() != n:
                raise ValueError(f"gradient has {g.numel()} elements, expected {n}")
            dst.copy_(g.reshape(-1))
        offset += n
    if stats is not None:
        row = stats if stats.dim() == 1 else stats[0]  # indexing, not view(): any strides
        row += sumsq_nonfinite(out)


STATS_BLOCK = 4096
"""Elements per block of the sum of squares' fixed order ([Note: determinism] in docs/design.md).
Below torch's parallel grain (32768 elements), so one thread sums a block in one order, and a sum over blocks
splits the blocks among threads, never a block: the same bits whatever ``torch.set_num_threads`` says. A plain
``torch.sum`` over a whole bucket instead adds per-thread partials, and its last bit followed the thread count."""

_STATS_CHUNK = 64 * STATS_BLOCK
"""Elements upcast and squared at a time on the CPU (elsewhere the whole tensor is one chunk: one launch per
op). NOTE: its 1 MiB of fp32 temporaries stays in cache, where the unblocked ``torch.sum(f * f)`` streamed
64 MiB ones: a 16 Mi-element bucket's statistics took 41 ms instead of 188 ms on one torch thread, 40 instead of
149 on two (idle 2-core box; [Note: determinism] in docs/design.md)."""


def sumsq_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """``[sum of squares, non-finite count]`` (float32 ``[2]``, on ``x``'s device) of ``x``'s values in fp32.

    The squares are summed per block of :data:`STATS_BLOCK` consecutive elements (the last one padded with
    zeros), then the blocks' sums the same way until one block is left: a fixed order, so the same bits whatever
    torch's thread count. The count is an integer sum (exact in any order).
    """
    flat = x.reshape(-1)
    n = flat.numel()
    blocks: list[torch.Tensor] = []
    bad = torch.zeros((), dtype=torch.int64, device=x.device)
    chunk = _STATS_CHUNK if x.device.type == "cpu" else max(n, 1)
    for start in range(0, n, chunk):
        f = flat[start : start + chunk].to(torch.float32)
        bad += f.numel() - torch.isfinite(f).sum()
        whole = f.numel() - f.numel() % STATS_BLOCK
        if whole:
            rows = f[:whole].view(-1, STATS_BLOCK)
            blocks.append((rows * rows).sum(dim=1))
        if whole < f.numel():  # the last block, in the last chunk
            last = f.new_zeros(1, STATS_BLOCK)
            last[0, : f.numel() - whole] = f[whole:]
            blocks.append((last * last).sum(dim=1))
    sums = torch.cat(blocks) if blocks else torch.zeros(1, device=x.device)
    while sums.numel() > STATS_BLOCK:  # more than 16 Mi elements: the block sums in blocks again
        sums = torch.cat([sums, sums.new_zeros(-sums.numel() % STATS_BLOCK)]).view(-1, STATS_BLOCK).sum(dim=1)
    return torch.stack([sums.sum(), bad.to(torch.float32)])


def scatter_flat_(
    flat: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    stochastic_rounding: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> None:
    """Copy consecutive slices of ``flat`` into ``params``, casting to each one's dtype (round to nearest even).

    With ``stochastic_rounding``, fp32 -> bf16 slices are rounded stochastically instead (see
    :func:`stochastic_round_to_bf16`; ``seed`` and ``offset`` select the random stream); other casts are
    unaffected.
    """
    total = sum(p.numel() for p in params)
    if total != flat.numel():
        raise ValueError(f"parameters hold {total} elements but the flat buffer has {flat.numel()}")
    rounded = None
    if stochastic_rounding and flat.dtype == torch.float32 and any(p.dtype == torch.bfloat16 for p in params):
        rounded = stochastic_round_to_bf16(flat.reshape(-1), seed=seed, offset=offset)  # keyed by flat index
    offset_el = 0
    for p in params:
        n = p.numel()
        src = rounded if (rounded is not None and p.dtype == torch.bfloat16) else flat
        p.copy_(src[offset_el : offset_el + n].view(p.shape))
        offset_el += n


_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def sr_keys(seed: int) -> tuple[int, int]:
    """The two 31-bit keys of the stochastic-rounding hash for ``seed`` (splitmix64 of it, split).

    31 bits so that Triton always types them ``int32`` (one compiled kernel whatever the seed).
    """
    z = (int(seed) + 0x9E37_79B9_7F4A_7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    z ^= z >> 31
    return z & 0x7FFF_FFFF, (z >> 32) & 0x7FFF_FFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2**32`` for int64 tensors of uint32 values, without int64 overflow (16-bit halves of c)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def noise16(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """16 random bits per int64 ``counter`` (int64 results in ``[0, 2**16)``): the Triton kernels' hash, bit
    for bit. ``fmix32(fmix32(lo ^ k0) ^ hi ^ k1) >> 16`` over the counter's 32-bit words."""
    k0, k1 = sr_keys(seed)
    lo = counter & _M32
    hi = (counter >> 32) & _M32
    x = _fmix32(lo ^ k0)
    x = _fmix32(x ^ hi ^ k1)
    return x >> 16


def stochastic_round_to_bf16(x: torch.Tensor, *, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """fp32 -> bf16 by stochastic rounding: add uniform random low 16 bits to the pattern, then truncate.

    Unbiased (the expectation is ``x``), always one of the two bf16 neighbours of ``x``; exact values,
    +-Inf and NaN pass through. Element ``i`` draws :func:`noise16` of counter ``offset + i`` under
    ``seed``: the same stream as the Triton scatter kernel, so both give the same bits (NaN patterns aside).
    """
    if x.dtype != torch.float32:
        raise ValueError(f"expected float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    counter = torch.arange(bits.numel(), dtype=torch.int64, device=x.device).view(bits.shape) + int(offset)
    rnd = noise16(counter, seed)
    finite = torch.isfinite(x).reshape(bits.shape)
    hi = torch.where(finite, (bits + rnd) >> 16, bits >> 16)
    hi = torch.where(hi >= 1 << 15, hi - (1 << 16), hi)  # to signed int16 range
    out = hi.to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), out)


def upcast_(src: torch.Tensor, dst: torch.Tensor, scale: float | torch.Tensor = 1.0) -> None:
    """``dst[:] = float32(src) * scale`` on flat buffers; ``scale`` a float or a 0-dim device tensor."""
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements but dst has {dst.numel()}")
    d = dst.view(-1)
    d.copy_(src.reshape(-1))
    if isinstance(scale, torch.Tensor) or scale != 1.0:
        d.mul_(scale)


def adamw_flat_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    hyper: AdamWHyper,
    grad_scale: float | torch.Tensor = 1.0,
    param_bf16_out: torch.Tensor | None = None,
) -> None:
    """One ``torch.optim.AdamW`` step (single-tensor path, same operation order) on flat fp32 buffers.

    ``g = grad * grad_scale`` (``grad_scale`` a float or a 0-dim fp32 tensor on the device, so a clip
    coefficient needs no host sync); ``step`` is the 1-based count after this update, ``hyper`` the group's
    hyper-parameters. ``param_bf16_out`` receives the updated parameters rounded to bf16.
    """
    # one eager AdamW for the whole package: the CPU op's twin runs on any device
    _adamw_reference.adamw_step_(
        param, grad, exp_avg, exp_avg_sq, step=step, hyper=hyper, grad_scale=grad_scale, param_bf16_out=param_bf16_out,
    )
